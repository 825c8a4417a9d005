"""GET /v1/models and /v1/models/{id} through the official `openai` client."""

from __future__ import annotations

import openai
import pytest

from tests.support.gateway import MODEL, Gateway, openai_client


def test_models_list_names_the_one_served_model(gateway: Gateway) -> None:
    models = openai_client(gateway).models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_a_model_by_id_and_an_unknown_id_in_openais_shape(gateway: Gateway) -> None:
    api = openai_client(gateway)
    model = api.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "prefixgate")
    assert model.created == api.models.list().data[0].created
    for unknown in ("gpt-4o", "org/some-model", "x" * 5000):
        with pytest.raises(openai.NotFoundError) as raised:
            api.models.retrieve(unknown)
        error = raised.value.body
        assert isinstance(error, dict) and error["code"] == "model_not_found"
        assert error["param"] == "model" and len(error["message"]) < 400
