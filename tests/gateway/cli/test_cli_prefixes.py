"""`prefixgate prefixes` against the real database."""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import Cli

MODEL = "smollm2-135m-instruct"


def test_prefix_commands_change_the_registry_and_refuse_duplicates_and_unknowns(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    text = tmp_path / "system.txt"
    text.write_text("You are a helpful assistant for Acme.\n")
    where = ["--model", MODEL, "--namespace", "default", "--name", "acme"]
    added = cli.json("prefixes", "add", *where, "--text-file", str(text))
    assert (added["name"], added["enabled"], added["characters"]) == ("acme", True, 38)
    assert "already exists" in cli.error("prefixes", "add", *where, "--text-file", str(text))
    cli.ok("prefixes", "disable", *where)
    assert cli.json("prefixes", "list", "--model", MODEL)[0]["enabled"] is False
    cli.ok("prefixes", "enable", *where)
    cli.ok("prefixes", "delete", *where)
    assert cli.json("prefixes", "list") == []
    assert "no prefix default/acme" in cli.error("prefixes", "delete", *where)


def test_a_bad_namespace_text_file_or_policy_is_one_line_naming_it(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    where = ["--model", MODEL, "--name", "x", "--text-file"]
    assert "is not in the policy's namespaces" in cli.error(
        "prefixes", "add", "--namespace", "secret-ns", *where, str(tmp_path / "none.txt")
    )
    assert "cannot read" in cli.error(
        "prefixes", "add", "--namespace", "default", *where, str(tmp_path / "none.txt")
    )
    bad_policy = tmp_path / "policy.yaml"
    bad_policy.write_text("min_public_blocks: -2\n")
    cli.env["PREFIXGATE_POLICY_FILE"] = str(bad_policy)
    line = cli.error("prefixes", "add", "--namespace", "default", *where, str(bad_policy))
    assert "field `min_public_blocks`" in line
