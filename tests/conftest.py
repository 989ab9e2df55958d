"""Fixtures shared by every test: real NATS and Valkey servers, the tiny model, offline mode."""

from __future__ import annotations

import os

# No downloads at run time, ever: models and tokenizers come from local directories.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton kernels run on CUDA when there is a GPU, else on CPU through the Triton interpreter.
# The interpreter must be chosen before triton is first imported (transformers imports it),
# so it is decided here, before anything else is imported.
import torch  # noqa: E402  (torch does not import triton)

os.environ.setdefault("STRATA_KERNEL_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
if os.environ["STRATA_KERNEL_DEVICE"] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from shared.localstack import LocalInfra
from shared.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def infra():
    """Embedded nats-server + valkey-server, or the ones named by STRATA_NATS_URL / STRATA_REDIS_URL."""
    stack = LocalInfra(nats_url=os.environ.get("STRATA_NATS_URL", ""),
                       redis_url=os.environ.get("STRATA_REDIS_URL", ""))
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def managed_stack(tiny_model_dir, tmp_path_factory):
    """A local stack with control and the scaler (local actuator): deployments applied through
    control get their engines from the scaler. Shared by the control and scaler tests. It has
    NATS and Valkey of its own: its scheduler must not take other stacks' requests (schedulers
    on one NATS form one queue group), nor its scaler see their deployments."""
    from shared.localstack import LocalStack

    s = LocalStack(str(tiny_model_dir), engines=0, control=True, scaler=True,
                   scaler_args=["--engine-arg=--threads=1"],
                   log_dir=tmp_path_factory.mktemp("managed-stack-logs"))
    s.start()
    yield s
    s.stop()
