"""Every /admin/api route is guarded: a bad credential gets 401, an inference key 403, and a
tenant-admin learns nothing of another tenant.

The routes come from the running app's OpenAPI spec, so a route added without the guard fails
here without anyone writing a test for it. Only `POST /admin/api/login` is open. The forged
tokens start from a real login's claims and change one thing each, and the unchanged claims
re-signed are the control: each refusal is due to that one thing.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import jwt
import pytest

from tenancy import admins
from tenancy.models import Admin
from tests.support.admin import login
from tests.support.gateway import JWT_SECRET, Gateway

OPEN_ROUTES = {("POST", "/admin/api/login")}
HTTP_METHODS = {"get", "put", "post", "delete", "patch"}
# Routes that span tenants, which a tenant-admin may not call whatever it names.
ADMIN_ONLY_PATHS = re.compile(r"^/admin/api/(prefixes|operators)(/|$)|^/admin/api/audit/verif")


@dataclass(frozen=True, slots=True)
class Route:
    """One operation of the admin API, as the spec describes it."""

    method: str
    path: str
    operation: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"

    @property
    def has_body(self) -> bool:
        return "requestBody" in self.operation

    def parameters(self, where: str) -> list[dict[str, Any]]:
        return [p for p in self.operation.get("parameters", []) if p["in"] == where]


@dataclass(frozen=True, slots=True)
class Spec:
    """The admin routes of the running app, and the spec to resolve their schemas in."""

    document: dict[str, Any]
    routes: list[Route]

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            name = schema["$ref"].removeprefix("#/components/schemas/")
            schema = self.document["components"]["schemas"][name]
        return schema

    def example(self, schema: dict[str, Any]) -> Any:
        """A minimal instance of `schema`: its required fields only, each at its lower bound."""
        schema = self.resolve(schema)
        options = schema.get("anyOf") or schema.get("oneOf") or schema.get("allOf")
        if options:
            typed = [o for o in options if self.resolve(o).get("type") != "null"] or options
            return self.example(typed[0])
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return schema["enum"][0]
        kind = schema.get("type")
        if kind == "object":
            fields = schema.get("properties", {})
            return {name: self.example(fields[name]) for name in schema.get("required", [])}
        if kind == "array":
            return [self.example(schema["items"]) for _ in range(schema.get("minItems", 0))]
        if kind in ("integer", "number"):
            return max(schema.get("minimum", 0), schema.get("exclusiveMinimum", -1) + 1)
        if kind == "boolean":
            return False
        if kind == "string":
            return _string(schema)
        return None

    def body(self, route: Route) -> Any:
        """A valid JSON body for the route (None when it takes none)."""
        if not route.has_body:
            return None
        content = route.operation["requestBody"]["content"]["application/json"]
        return self.example(content["schema"])

    def query(self, route: Route) -> dict[str, Any]:
        """Values for the route's required query parameters."""
        return {
            p["name"]: self.example(p.get("schema", {}))
            for p in route.parameters("query")
            if p.get("required")
        }


def _string(schema: dict[str, Any]) -> str:
    if schema.get("format") == "uuid":
        return str(uuid.uuid4())
    if schema.get("format") == "date-time":
        return datetime.now(UTC).isoformat()
    # Lowercase letters and digits fit slugs, names, namespaces and key ids alike.
    text = f"guard{uuid.uuid4().hex[:10]}"
    text = text.ljust(schema.get("minLength", 1), "x")
    return text[: schema.get("maxLength", len(text))]


def _path(route: Route, values: dict[str, str]) -> str:
    """The route's path with its parameters filled: `values` by name, else made up."""
    filled = {
        p["name"]: values.get(p["name"]) or _string(p.get("schema", {}))
        for p in route.parameters("path")
    }
    return route.path.format(**filled)


@pytest.fixture(scope="module")
def spec(gateway: Gateway) -> Spec:
    answer = httpx.get(f"{gateway.server.url}/openapi.json")
    assert answer.status_code == 200, answer.text
    document = answer.json()
    routes = [
        Route(method.upper(), path, operation)
        for path, operations in document["paths"].items()
        if path.startswith("/admin/api/")
        for method, operation in operations.items()
        if method in HTTP_METHODS and (method.upper(), path) not in OPEN_ROUTES
    ]
    labels = {route.label for route in routes}
    # The enumeration itself must work, or every check below passes vacuously.
    assert {"GET /admin/api/me", "POST /admin/api/logout", "GET /admin/api/tenants"} <= labels
    assert any("{tenant_id}" in route.path for route in routes)
    return Spec(document, routes)


@pytest.fixture(scope="module")
def root_token(gateway: Gateway) -> str:
    return login(gateway)


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.server.url, timeout=30) as opened:
        yield opened


def _call(
    client: httpx.Client,
    route: Route,
    credential: str | None,
    path: str | None = None,
    body: Any = None,
    query: dict[str, Any] | None = None,
) -> httpx.Response:
    """Call the route with `credential` (None: no Authorization header)."""
    headers = {} if credential is None else {"Authorization": f"Bearer {credential}"}
    json_body = body if body is not None else ({} if route.has_body else None)
    return client.request(
        route.method, path or _path(route, {}), headers=headers, json=json_body, params=query
    )


def _wrong(answer: httpx.Response, status: int, error_type: str) -> str | None:
    """What is wrong with the answer, if it is not this status in OpenAI's error shape."""
    if answer.status_code != status:
        return f"answered {answer.status_code}: {answer.text[:300]}"
    try:
        error = answer.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"answered {status} but not OpenAI's error shape: {answer.text[:300]}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"answered {status} with a malformed error: {error}"
    if error["type"] != error_type:
        return f"answered {status} with error type {error['type']!r}, not {error_type!r}"
    return None


def _refusals(
    client: httpx.Client,
    routes: list[Route],
    credentials: dict[str, str | None],
    status: int,
    error_type: str,
) -> list[str]:
    """Every (route, credential) that is not refused as expected, described."""
    problems = []
    for name, credential in credentials.items():
        for route in routes:
            problem = _wrong(_call(client, route, credential), status, error_type)
            if problem is not None:
                problems.append(f"{route.label} with {name}: {problem}")
    return problems


def _b64(data: dict[str, Any]) -> str:
    raw = json.dumps(data, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _signed(claims: dict[str, Any], secret: str = JWT_SECRET, algorithm: str = "HS256") -> str:
    with warnings.catch_warnings():  # PyJWT warns that the test secret is short for HS512
        warnings.simplefilter("ignore", jwt.warnings.InsecureKeyLengthWarning)
        return jwt.encode(claims, secret, algorithm=algorithm)


def _forged(claims: dict[str, Any], leeway_s: int) -> dict[str, str | None]:
    """Tokens that are a real session's token with one thing wrong, and plain garbage."""
    now = int(time.time())
    expired = {**claims, "iat": now - 3600, "nbf": now - 3600, "exp": now - leeway_s - 60}
    unsigned = f"{_b64({'alg': 'none', 'typ': 'JWT'})}.{_b64(claims)}."
    without_jti = {name: value for name, value in claims.items() if name != "jti"}
    return {
        "no Authorization header": None,
        "a token expired beyond the leeway": _signed(expired),
        "a token signed with a wrong secret": _signed(
            claims, "another-secret-of-32-bytes-or-more!"
        ),
        "a hand-made alg=none token": unsigned,
        "PyJWT's alg=none token": jwt.encode(claims, None, algorithm="none"),
        "a token for another audience": _signed({**claims, "aud": "prefixgate-inference"}),
        "a token from another issuer": _signed({**claims, "iss": "not-prefixgate"}),
        "an HS512 token with the right secret": _signed(claims, algorithm="HS512"),
        "a token without jti": _signed(without_jti),
        "a token for another operator's session": _signed({**claims, "sub": str(uuid.uuid4())}),
        "garbage": "garbage.not-a.jwt",
        "a malformed API key": "pgk_notakey_garbage",
    }


def test_every_admin_route_refuses_forged_expired_and_garbage_tokens(
    gateway: Gateway, spec: Spec, client: httpx.Client, root_token: str
) -> None:
    claims = jwt.decode(root_token, options={"verify_signature": False})
    me = next(route for route in spec.routes if route.label == "GET /admin/api/me")
    # The control: the same claims signed the right way are a working token.
    assert _call(client, me, _signed(claims)).status_code == 200
    leeway_s = gateway.server.gateway.settings.admin_token_leeway_s
    problems = _refusals(
        client, spec.routes, _forged(claims, leeway_s), 401, "authentication_error"
    )
    assert not problems, "\n".join(problems)
    assert _call(client, me, root_token).status_code == 200  # and nothing above ended it


def test_every_admin_route_refuses_an_ended_session(
    gateway: Gateway, spec: Spec, client: httpx.Client
) -> None:
    logged_out = login(gateway)
    me = next(route for route in spec.routes if route.label == "GET /admin/api/me")
    logout = next(route for route in spec.routes if route.label == "POST /admin/api/logout")
    assert _call(client, me, logged_out).status_code == 200
    assert _call(client, logout, logged_out).status_code == 204
    disabled = _disabled_operator_token(gateway)
    problems = _refusals(
        client,
        spec.routes,
        {"a logged-out session's token": logged_out, "a disabled operator's token": disabled},
        401,
        "authentication_error",
    )
    assert not problems, "\n".join(problems)


def _disabled_operator_token(gateway: Gateway) -> str:
    """A working admin token whose operator is then disabled, its session left open."""
    username, password = f"guard-{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    store = gateway.server.gateway.store
    with store.transaction() as session:
        operator_id = admins.create_admin(session, username, password).id
    token = login(gateway, username, password)
    headers = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{gateway.admin_url}/me", headers=headers).status_code == 200
    with store.transaction() as session:
        # The flag alone, not `set_disabled` (which also revokes its sessions): the guard must
        # read the account on every call, not rely on the session being revoked.
        operator = session.get(Admin, operator_id)
        assert operator is not None
        operator.disabled = True
    return token


def test_every_admin_route_refuses_an_inference_key(
    gateway: Gateway, spec: Spec, client: httpx.Client
) -> None:
    credentials: dict[str, str | None] = {"acme's inference key": gateway.keys["acme"]}
    problems = _refusals(client, spec.routes, credentials, 403, "permission_error")
    assert not problems, "\n".join(problems)


def _tenant_id(client: httpx.Client, root_token: str, slug: str) -> str:
    headers = {"Authorization": f"Bearer {root_token}"}
    answer = client.get("/admin/api/tenants", params={"q": slug}, headers=headers)
    assert answer.status_code == 200, answer.text
    return next(str(row["id"]) for row in answer.json()["data"] if row["slug"] == slug)


def _names_a_tenant(route: Route) -> bool:
    """Whether the route takes a tenant's id, in its path or as a filter."""
    in_query = any(p["name"] == "tenant_id" for p in route.parameters("query"))
    return "{tenant_id}" in route.path or in_query


def _same_answer_as_for_nothing(
    theirs: httpx.Response, their_id: str, nothing: httpx.Response, missing_id: str
) -> str | None:
    """What tells the two answers apart, once each names its own id the same way."""
    if theirs.status_code != nothing.status_code:
        return f"{theirs.status_code} ({theirs.text[:200]}) but {nothing.status_code} for none"
    if theirs.text.replace(their_id, "<id>") != nothing.text.replace(missing_id, "<id>"):
        return f"{theirs.text[:200]!r} but {nothing.text[:200]!r} for none"
    return None


def test_tenant_admin_gets_the_same_404_for_another_tenant_as_for_none(
    gateway: Gateway, spec: Spec, client: httpx.Client, root_token: str
) -> None:
    globex_id = _tenant_id(client, root_token, "globex")
    acme_admin = gateway.tenant_admin_keys["acme"]
    routes = [route for route in spec.routes if _names_a_tenant(route)]
    assert any(route.parameters("query") and "{tenant_id}" not in route.path for route in routes)
    problems = []
    for route in routes:
        # One body, query and set of other ids for both calls, so only the tenant differs.
        body, query, missing_id = spec.body(route), spec.query(route), str(uuid.uuid4())
        in_path = "{tenant_id}" in route.path
        others = {p["name"]: _string(p.get("schema", {})) for p in route.parameters("path")}
        theirs, nothing = (
            _call(
                client,
                route,
                acme_admin,
                _path(route, {**others, "tenant_id": tenant_id}),
                body,
                query if in_path else {**query, "tenant_id": tenant_id},
            )
            for tenant_id in (globex_id, missing_id)
        )
        # A change a tenant-admin may never make is a 403 whatever the id; anything else a 404.
        allowed = (404,) if route.method == "GET" else (403, 404)
        expected_type = {403: "permission_error", 404: "not_found_error"}
        problem = (
            _wrong(theirs, theirs.status_code, expected_type.get(theirs.status_code, "?"))
            if theirs.status_code in allowed
            else f"answered {theirs.status_code}: {theirs.text[:300]}"
        )
        problem = problem or _same_answer_as_for_nothing(theirs, globex_id, nothing, missing_id)
        if problem is None and "globex" in theirs.text.lower():
            problem = f"names globex: {theirs.text[:300]}"
        if problem is not None:
            problems.append(f"{route.label} by acme's tenant-admin for globex: {problem}")
    assert not problems, "\n".join(problems)


def test_tenant_admin_cannot_reach_another_tenants_key_through_its_own_tenant(
    gateway: Gateway, spec: Spec, client: httpx.Client, root_token: str
) -> None:
    root = {"Authorization": f"Bearer {root_token}"}
    victim = client.post("/admin/api/tenants", json={"slug": f"victim-{uuid.uuid4().hex[:8]}"},
                         headers=root)  # fmt: skip
    assert victim.status_code == 201, victim.text
    victim_keys = f"/admin/api/tenants/{victim.json()['id']}/keys"
    created = client.post(victim_keys, json={"name": "victim"}, headers=root)
    assert created.status_code == 201, created.text
    victim_key_id = created.json()["key_id"]
    acme_id = _tenant_id(client, root_token, "acme")
    routes = [route for route in spec.routes if {"{tenant_id}", "{key_id}"} <= _names(route)]
    assert routes, "no key route to check"
    problems = []
    for route in routes:
        body, missing_id = spec.body(route), f"guard{uuid.uuid4().hex[:7]}"
        theirs, nothing = (
            _call(
                client,
                route,
                gateway.tenant_admin_keys["acme"],
                _path(route, {"tenant_id": acme_id, "key_id": key_id}),
                body,
            )
            for key_id in (victim_key_id, missing_id)
        )
        problem = _wrong(theirs, 404, "not_found_error") or _same_answer_as_for_nothing(
            theirs, victim_key_id, nothing, missing_id
        )
        if problem is not None:
            problems.append(f"{route.label} by acme's tenant-admin for another's key: {problem}")
    assert not problems, "\n".join(problems)
    keys = client.get(victim_keys, headers=root).json()
    assert [(key["key_id"], key["state"]) for key in keys] == [(victim_key_id, "active")]


def _names(route: Route) -> set[str]:
    return {f"{{{p['name']}}}" for p in route.parameters("path")}


def test_tenant_admin_is_refused_routes_that_span_tenants(
    gateway: Gateway, spec: Spec, client: httpx.Client
) -> None:
    routes = [
        route
        for route in spec.routes
        if ADMIN_ONLY_PATHS.match(route.path) or route.label == "POST /admin/api/tenants"
    ]
    assert {"POST /admin/api/tenants", "GET /admin/api/prefixes", "GET /admin/api/operators"} <= {
        route.label for route in routes
    }
    problems = []
    for route in routes:
        # A valid body and query, so that only the caller's role can be the reason to refuse.
        answer = _call(
            client, route, gateway.tenant_admin_keys["acme"], None, spec.body(route),
            spec.query(route),
        )  # fmt: skip
        problem = _wrong(answer, 403, "permission_error")
        if problem is not None:
            problems.append(f"{route.label} by acme's tenant-admin: {problem}")
    assert not problems, "\n".join(problems)


def test_what_a_tenant_admin_may_list_holds_nothing_of_another_tenant(
    gateway: Gateway, spec: Spec, client: httpx.Client, root_token: str
) -> None:
    globex_id = _tenant_id(client, root_token, "globex")
    own_key_id = gateway.tenant_admin_keys["acme"].split("_")[1]
    listings = [route for route in spec.routes if route.method == "GET" and not _names(route)]
    problems = []
    for route in listings:
        answer = _call(client, route, gateway.tenant_admin_keys["acme"], query=spec.query(route))
        if answer.status_code == 403 and ADMIN_ONLY_PATHS.match(route.path):
            continue
        if answer.status_code != 200:
            problems.append(f"{route.label}: answered {answer.status_code}: {answer.text[:300]}")
            continue
        # acme's own refused reaches into globex are in acme's log, with the id acme sent.
        text = _without_own_attempts(answer.text, own_key_id)
        if "globex" in text.lower() or globex_id in text:
            problems.append(f"{route.label}: names globex: {text[:300]}")
    assert not problems, "\n".join(problems)


def _without_own_attempts(text: str, key_id: str) -> str:
    """An audit listing (JSON page or JSONL export) less the events `key_id` caused."""
    try:
        page = json.loads(text)
    except json.JSONDecodeError:  # an export: one record per line
        lines = [line for line in text.splitlines() if f'"actor_id": "{key_id}"' not in line]
        return "\n".join(lines)
    if isinstance(page, dict) and isinstance(page.get("data"), list):
        page["data"] = [
            event for event in page["data"]
            if not (isinstance(event, dict) and event.get("actor_id") == key_id)
        ]  # fmt: skip
    return json.dumps(page)
