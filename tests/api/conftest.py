"""One local stack (engine, scheduler, gateway as processes, the tiny model) for the tests of
the OpenAI API surface, with the official `openai` client. Random weights make it obvious
whether a constraint works: unconstrained output is noise."""

import openai
import pytest

from shared.localstack import LocalStack

MODEL = "tiny-llama"


@pytest.fixture(scope="package")
def api_stack(infra, tiny_model_dir, tmp_path_factory):
    s = LocalStack(str(tiny_model_dir), engines=1, nats_url=infra.nats_url, redis_url=infra.redis_url,
                   engine_args=["--num-kv-blocks", "1024"],
                   gateway_args=["--serve", str(tiny_model_dir)],
                   log_dir=tmp_path_factory.mktemp("api-stack-logs"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="package")
def client(api_stack):
    return openai.OpenAI(base_url=api_stack.base_url + "/v1", api_key=api_stack.api_key, max_retries=0)


@pytest.fixture(scope="package")
def aclient(api_stack):
    return openai.AsyncOpenAI(base_url=api_stack.base_url + "/v1", api_key=api_stack.api_key, max_retries=0)
