"""GET /v1/models through the official `openai` client."""

from __future__ import annotations

from tests.support.gateway import MODEL, Gateway, openai_client


def test_models_list_names_the_one_served_model(gateway: Gateway) -> None:
    models = openai_client(gateway).models.list()
    assert [model.id for model in models.data] == [MODEL]
