"""A whole local stack (engine, scheduler, gateway as processes) for end-to-end tests."""

import shutil

import pytest

from shared.localstack import LocalStack


@pytest.fixture(scope="package")
def spare_model_dir(tiny_model_dir, tmp_path_factory):
    """A second served model that no engine runs (for the no-replica error)."""
    spare = tmp_path_factory.mktemp("spare") / "tiny-spare"
    shutil.copytree(tiny_model_dir, spare)
    return spare


@pytest.fixture(scope="package")
def stack(infra, tiny_model_dir, spare_model_dir, tmp_path_factory):
    s = LocalStack(str(tiny_model_dir), engines=1, nats_url=infra.nats_url, redis_url=infra.redis_url,
                   engine_args=["--num-kv-blocks", "1024", "--lease-ttl", "3"],
                   gateway_args=["--serve", str(tiny_model_dir), "--serve", str(spare_model_dir)],
                   log_dir=tmp_path_factory.mktemp("stack-logs"))
    s.start()
    yield s
    s.stop()
