"""LangChain's `ChatOpenAI` (langchain-openai, unmodified) against a real server on the
embedded model: its default `invoke`, `stream` and `with_structured_output(PydanticModel)`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.support.gateway import sqlite_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_model(smollm2: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChatOpenAI]:
    with sqlite_gateway(tmp_path_factory.mktemp("langchain-gateway"), smollm2) as (server, key):
        yield ChatOpenAI(
            base_url=f"{server.url}/v1", api_key=key,  # type: ignore[arg-type]
            model="smollm2-135m-instruct", temperature=0, max_tokens=40, max_retries=0,
        )  # fmt: skip


def test_invoke_and_stream_give_the_same_answer(chat_model: ChatOpenAI) -> None:
    question = "What is the capital of France?"
    answer = chat_model.invoke(question)
    assert isinstance(answer.content, str) and "Paris" in answer.content
    streamed = "".join(str(chunk.content) for chunk in chat_model.stream(question))
    assert streamed == answer.content


class City(BaseModel):
    name: str
    country: str


def test_with_structured_output_returns_the_pydantic_model(chat_model: ChatOpenAI) -> None:
    structured = chat_model.with_structured_output(City)
    city = structured.invoke("Paris is the capital of France. Give the city and its country.")
    assert isinstance(city, City) and city.name == "Paris"
