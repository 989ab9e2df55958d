"""One schema of engine arguments (services.engine.config.EngineArgs): the engine's flags, the
deployment spec's engine keys, the scaler's and the local stack's engine command lines are all
made from it, and an unknown one is refused naming it wherever it is given. Engines started on
one machine split its cores between them (services.engine.launch) unless told otherwise.

The engines the actuator starts here are fake engine processes (a shell that sleeps): what is
tested is their command line and environment, not a model."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.control.spec import ENGINE_ARGS, SpecError, validate
from services.engine.__main__ import build_parser
from services.engine.config import EngineArgs, arg
from services.engine.launch import CoreShares, check_engine_flags, thread_share, threads_chosen
from services.scaler.actuators import LocalProcessActuator
from shared.deployments import DeploymentSpec, Replicas
from shared.localstack import LocalStack


@dataclasses.dataclass
class WithOneMore(EngineArgs):
    """EngineArgs and one argument more: the one place a new argument is declared."""
    step_order: str = arg("fifo", "the order waiting requests are scheduled in: fifo or priority")


def engine_group_flags(parser: argparse.ArgumentParser) -> set[str]:
    (group,) = [g for g in parser._action_groups if g.title == "engine"]
    return {s for action in group._group_actions for s in action.option_strings}


def test_one_field_added_to_the_schema_appears_as_flag_spec_key_and_command_line():
    parser = argparse.ArgumentParser()
    WithOneMore.add_cli_args(parser)
    assert "--step-order" in engine_group_flags(parser)
    assert WithOneMore.spec_args()["step_order"] is str and "step_order" not in EngineArgs.spec_args()
    flags = WithOneMore.cli_flags({"step_order": "priority", "max_num_seqs": 8})
    assert flags == ["--step-order", "priority", "--max-num-seqs", "8"]
    args = WithOneMore.from_cli_args(parser.parse_args(flags))
    assert (args.step_order, args.max_num_seqs) == ("priority", 8)
    assert WithOneMore.spec_problems({"step_order": "priority"}) == []


def test_the_engine_flags_and_the_spec_keys_are_the_schema():
    schema = EngineArgs.schema()
    # Every flag of the engine's "engine" group comes from the schema (and the one old spelling).
    assert engine_group_flags(build_parser()) == \
        {a.flag for a in schema} | {"--no-" + a.flag[2:] for a in schema if a.kind is bool} | {"--no-prefix-caching"}
    assert ENGINE_ARGS == {a.key: a.kind for a in schema if a.spec}
    # Names kept from before the one schema: the spec key and flag of num_threads is threads.
    assert {"threads", "debug_step_delay", "max_num_seqs", "num_kv_blocks", "kv_cache_dtype", "speculative_config",
            "max_loras"} <= set(ENGINE_ARGS)


def sample_value(a):
    """A value of the argument's type other than its default."""
    if a.kind is bool:
        return not a.default
    if a.kind in (int, float):
        return (a.default or 0) + (3 if a.kind is int else 0.25)
    return {str: "x-value", dict: {"method": "ngram", "k": [1, 2]}}[a.kind]


def environ_of(proc: subprocess.Popen) -> dict[str, str]:
    deadline = time.monotonic() + 5
    while True:  # the shell has exec'd sleep once its environment is readable
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
        if raw or time.monotonic() > deadline:
            return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        time.sleep(0.02)


async def test_the_scalers_command_line_carries_every_spec_key_to_the_engines_flags(fake_engine_processes, tmp_path):
    engine = {a.key: sample_value(a) for a in EngineArgs.schema() if a.spec}
    spec = DeploymentSpec(name="llm", model="/models/llm", engine=engine)
    actuator = LocalProcessActuator("nats://127.0.0.1:1", "redis://127.0.0.1:1", tmp_path)
    try:
        await actuator.scale("llm", 3, spec, 1, {})
        (replica,) = actuator.replicas("llm", 3)
        argv = replica.proc.args
        assert argv[1:3] == ["-m", "services.engine"]
        parsed = build_parser().parse_args(argv[3:])
    finally:
        await actuator.close()
    assert (parsed.settings_model, parsed.deployment, parsed.revision) == ("/models/llm", "llm", 3)
    for a in EngineArgs.schema():
        if a.spec:
            assert getattr(parsed, a.name) == engine[a.key], a.key


async def test_local_engines_split_the_cores_unless_their_threads_are_given(fake_engine_processes, tmp_path,
                                                                             monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = DeploymentSpec(name="llm", model="/models/llm", replicas=Replicas(min=2, max=2))
    cores = CoreShares(cores=4)
    actuator = LocalProcessActuator("nats://127.0.0.1:1", "redis://127.0.0.1:1", tmp_path, cores=cores)
    pinned = LocalProcessActuator("nats://127.0.0.1:1", "redis://127.0.0.1:1", tmp_path, cores=cores,
                                  extra_args=["--threads=3"], capacity=1, pool="pinned")
    try:
        await actuator.scale("llm", 1, spec, 2, {})
        for replica in actuator.replicas("llm", 1):
            argv = replica.proc.args
            # Two engines planned here and one in the other pool, on four cores: one thread each.
            assert argv[-2:] == ["--threads", "1"] and build_parser().parse_args(argv[3:]).num_threads == 1
            assert environ_of(replica.proc)["OMP_NUM_THREADS"] == "1"
        await pinned.scale("llm", 1, spec, 1, {})  # an explicit --threads wins
        (replica,) = pinned.replicas("llm", 1)
        assert replica.proc.args[-1] == "--threads=3" and "OMP_NUM_THREADS" not in environ_of(replica.proc)
        # Scaled to zero without a spec (a revision no longer served): its engines no longer count.
        await actuator.scale("llm", 1, None, 0, {})
        deadline = time.monotonic() + 10
        while actuator.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        await actuator.observe(["llm"])
        assert cores.threads() == 4  # only the pinned pool's capacity of 1 is planned now
    finally:
        await actuator.close()
        await pinned.close()
    assert cores.threads() == 4  # both closed: nothing planned


def test_thread_shares():
    assert [thread_share(n, cores=2) for n in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert thread_share(3, cores=16) == 5
    assert threads_chosen(["--threads", "2"], {}) and threads_chosen(["--threads=2"], {})
    assert threads_chosen([], {"OMP_NUM_THREADS": "2"}) and not threads_chosen(["--threads-x"], {})
    args, env = CoreShares(cores=2, planned={"a": 2}).launch(["--model", "m"], {"PATH": "/bin"})
    assert args == ["--model", "m", "--threads", "1"] and env == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    args, env = CoreShares(cores=2, planned={"a": 2}).launch(["--model", "m"], {"OMP_NUM_THREADS": "2"})
    assert args == ["--model", "m"] and env == {"OMP_NUM_THREADS": "2"}


def test_an_unknown_or_bad_engine_flag_is_refused_naming_it():
    check_engine_flags(["--threads", "1", "--max-num-seqs=8", "--lease-ttl", "3", "--log-level", "warning"])
    with pytest.raises(ValueError, match="unknown engine flag: --turbo"):
        check_engine_flags(["--threads", "1", "--turbo"])
    with pytest.raises(ValueError, match="--max-num-seqs: invalid int value: 'many'"):
        check_engine_flags(["--max-num-seqs", "many"])


def test_the_scaler_refuses_an_unknown_engine_arg_naming_it_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "services.scaler", "--nats-url", "nats://127.0.0.1:1",
                           "--redis-url", "redis://127.0.0.1:1", "--engine-arg=--turbo"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--engine-arg: unknown engine flag: --turbo" in proc.stderr, proc.stderr


def test_the_local_stack_refuses_an_unknown_engine_flag_naming_it(tiny_model_dir, tmp_path):
    stack = LocalStack(str(tiny_model_dir), engine_args=["--turbo"], log_dir=tmp_path)
    with pytest.raises(ValueError, match="--turbo"):
        stack.start()
    assert not stack.services  # nothing was started (and the infrastructure is stopped)


def test_the_engine_refuses_arguments_that_cannot_run_naming_them_before_loading_a_model(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "services.engine", "--model", str(tiny_model_dir),
                           "--nats-url", "nats://127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1",
                           "--block-size", "3", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "block_size: must be a power of two, got 3" in proc.stderr and "max_num_seqs: must be >= 1" in proc.stderr


@pytest.mark.parametrize("engine, field, reason", [
    ({"block_size": 12}, "engine.block_size", "must be a power of two"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "engine.max_cpu_loras", "must be >= max_loras (4)"),
    ({"enable_lora": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "engine.speculative_config", "not supported together with enable_lora"),
    ({"sampler_backend": "cuda"}, "engine.sampler_backend", "must be one of auto, torch, triton"),
])
def test_a_spec_is_refused_for_what_the_engine_would_refuse_at_start(tiny_model_dir, engine, field, reason):
    """The spec runs the engine's own checks (of one argument and across arguments)."""
    with pytest.raises(SpecError) as info:
        validate({"name": "tiny", "model": str(tiny_model_dir), "engine": engine})
    assert reason in dict(info.value.errors)[field], info.value.errors
