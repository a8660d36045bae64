"""``fsdp_shell.predict`` in one process: a model on the meta device in, a prediction out, with no
process group and no memory; models named on the command line; ``fsdp-plan --model``. That the
prediction is what gloo worlds really hold is ``tests/worlds/test_predict_gloo.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_core import Event, HookEvent, MixedPrecision, PerUnitGathers
from fsdp_core.memory import Category, Mark, Phase
from fsdp_core.sim import Activity, Link
from fsdp_shell.cli.plan import main
from fsdp_shell.memory import LiveBytes
from fsdp_shell.predict import predict_memory
from fsdp_shell.predict.model import Prediction, predict_time
from fsdp_shell.predict.spec import load_model


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.lin(x)) * self.scale + x
        return out


def net() -> nn.Module:
    return nn.Sequential(Layer(), Layer(), nn.Linear(16, 4))


def broken() -> nn.Module:
    raise RuntimeError("no weights today")


def step(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(torch.randn(8, 16)).float().square().mean()
    return out


def factory_with_step() -> tuple[nn.Module, object]:
    return net(), step


def test_a_real_model_is_left_as_it_was_and_still_trains() -> None:
    model = net()
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    buffers = dict(model.named_buffers())
    prediction = predict_memory(model, step, world_size=4, auto_wrap_policy={Layer}, backend="gloo")
    assert dict(model.named_buffers()) == buffers
    for name, p in model.named_parameters():
        assert p is params[name][0] and torch.equal(p, params[name][1]), name
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    torch.autograd.backward(step(model))
    assert all(p.grad is not None for p in model.parameters())
    assert len(prediction.ranks) == 4
    assert prediction.paths == ("0", "1", "")


def test_the_trace_follows_the_hooks_in_program_order() -> None:
    """The root's forward around the units', every pre-backward before the unit's post-backward,
    each unit's gradient taken at its hook: 16 x 16 + 16 fp32 elements per layer (1088 B), bf16
    when computing in bf16 (544 B)."""
    with torch.device("meta"):
        model = net()
    for dtype, grad in ((None, 1088), (torch.bfloat16, 544)):
        prediction = predict_memory(
            model,
            step,
            world_size=2,
            auto_wrap_policy={Layer},
            mixed_precision=MixedPrecision(param_dtype=dtype),
            backend="gloo",
        )
        points = prediction.trace.points
        assert [p.at for p in points[:3]] == [
            Mark.FORWARD_START,
            HookEvent(Event.PRE_FORWARD, 2),
            HookEvent(Event.PRE_FORWARD, 0),
        ]
        assert prediction.trace.forward_order == (2, 0, 1)
        assert prediction.trace.backward_order == (2, 1, 0)
        taken = {p.at.unit: p.taken for p in points if p.taken and isinstance(p.at, HookEvent)}
        assert taken[0] == taken[1] == grad
        assert points[-1].live == 0, "nothing of the step outlives it"


def test_every_rank_is_predicted_and_named_by_phase() -> None:
    with torch.device("meta"):
        model = net()
    prediction = predict_memory(model, step, world_size=2, auto_wrap_policy={Layer}, accumulate=2, backend="nccl")
    memory = prediction.worst
    assert [(p.phase, p.micro) for p in memory.peaks] == [
        (Phase.FORWARD, 0),
        (Phase.BACKWARD, 0),
        (Phase.FORWARD, 1),
        (Phase.BACKWARD, 1),
        (Phase.OPTIMIZER, -1),
    ]
    assert memory.phase_peak(Phase.BACKWARD).breakdown[Category.GRADS_CARRIED] > 0, "no_sync's accumulation"
    assert memory.after_step[Category.BUFFERS] == 2 * 512, "two 64 B buffers in 512-byte blocks"


def test_the_accelerator_prediction_holds_cublas_workspaces() -> None:
    """``nccl``: every phase holds what cuBLAS keeps (65 MiB on an H100/H200 by torch's defaults,
    the rule of ``cuda_workspaces``); ``workspace=`` replaces it; gloo has none."""
    with torch.device("meta"):
        model = net()
    default = predict_memory(model, step, world_size=2, auto_wrap_policy={Layer}, backend="nccl").worst
    given = predict_memory(model, step, world_size=2, auto_wrap_policy={Layer}, backend="nccl", workspace=0).worst
    expected = 2 * 32 * 2**20 + 2**20 if not torch.cuda.is_available() else default.after_step[Category.WORKSPACE]
    assert all(p.breakdown[Category.WORKSPACE] == expected for p in default.peaks)
    assert [p.bytes - q.bytes for p, q in zip(default.peaks, given.peaks)] == [expected] * len(default.peaks)
    gloo = predict_memory(model, step, world_size=2, auto_wrap_policy={Layer}, backend="gloo").worst
    assert gloo.after_step[Category.WORKSPACE] == 0


def test_bad_arguments_are_named() -> None:
    with torch.device("meta"):
        model = net()
    with pytest.raises(ValueError, match="backend"):
        predict_memory(model, step, world_size=2, backend="mpi")
    with pytest.raises(ValueError, match="accumulate"):
        predict_memory(model, step, world_size=2, accumulate=0)
    with pytest.raises(ValueError, match="optimizer"):
        predict_memory(model, step, world_size=2, optimizer="lion")
    with pytest.raises(ValueError, match="shard_size"):
        predict_memory(model, step, world_size=4, shard_size=3, sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match="workspace"):
        predict_memory(model, step, world_size=2, workspace=-1)


# -- models by name ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["demo", "gpt2-tiny", "llama-tiny"])
def test_built_in_models_are_built_on_meta_with_their_blocks_as_units(spec: str) -> None:
    loaded = load_model(spec, batch_size=2, seq=8)
    assert all(p.is_meta for p in loaded.module.parameters())
    assert {c.__name__ for c in loaded.wrap} <= {"Block", "GPT2Block", "LlamaDecoderLayer"}
    assert loaded.inputs == "2 x 8 tokens"


def test_a_hugging_face_config_file_and_a_factory(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 3, "n_head": 2, "vocab_size": 32}))
    loaded = load_model(str(config))
    assert sum(1 for m in loaded.module.modules() if type(m).__name__ == "GPT2Block") == 3
    assert loaded.inputs == "8 x 1024 tokens"
    made = load_model("tests.shell.test_predict:factory_with_step", wrap=["Layer"])
    assert made.wrap == frozenset({Layer})
    plain = load_model("tests.shell.test_predict:net", input_shape=[4, 16])
    assert plain.inputs == "randn(4, 16)" and not plain.wrap


def test_models_that_cannot_be_loaded_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: unknown 'resnet'"):
        load_model("resnet")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        load_model(str(bad))
    bad.write_text("{}")
    with pytest.raises(ValueError, match="no model_type"):
        load_model(str(bad))
    with pytest.raises(ValueError, match="no language model"):
        load_model("tests.shell.test_predict:net")
    with pytest.raises(ValueError, match="cannot import"):
        load_model("tests.nowhere:net")
    needs = r"SPEC must name a callable taking no arguments that returns an nn.Module or a pair \(module, step\)"
    with pytest.raises(ValueError, match=r"model: os.path:join\(a, \*p\) needs arguments; " + needs):
        load_model("os.path:join")
    with pytest.raises(ValueError, match=r"model: os:getcwd returned str; " + needs):
        load_model("os:getcwd")
    with pytest.raises(ValueError, match=r"model: math:nan is not callable; " + needs):
        load_model("math:nan")
    with pytest.raises(
        ValueError, match=r"tests.shell.test_predict:broken\(\) raised RuntimeError: no weights today; " + needs
    ):
        load_model("tests.shell.test_predict:broken")
    with pytest.raises(ValueError, match="wrap: no module of class Conv2d"):
        load_model("demo", wrap=["Conv2d"])


# -- fsdp-plan --model ---------------------------------------------------------------------------


def test_fsdp_plan_model_prints_units_and_phases(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "llama-tiny", "--world-size", "2", "--backend", "gloo", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "model: llama-tiny, 6,736 parameters in 3 units" in out
    assert "model.layers.0" in out and "... unit 1 the same" in out
    for row in ("forward", "backward", "optimizer", "between steps", "peak:"):
        assert row in out
    assert "step time, modeled" in out and "at 100 TFLOP/s (traced FLOPs)" in out


def test_fsdp_plan_model_json_has_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "gpt2-tiny", "--world-size", "4", "--strategy", "HYBRID_SHARD", "--shard-size", "2"]
    assert main([*argv, "--param-dtype", "bf16", "--grad-accum", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4 and len(out["ranks"]) == 2
    peaks = out["ranks"][0]["peaks"]
    assert [p["phase"] for p in peaks] == ["forward", "backward", "forward", "backward", "optimizer"]
    assert all(sum(p["breakdown"].values()) == p["bytes"] for p in peaks)
    assert [u["module"] for u in out["units"]] == ["transformer.h.0", "transformer.h.1", ""]
    time = out["step_time"]
    assert time["step_ms"] == pytest.approx(time["no_sync_ms"] + time["sync_ms"]) and time["no_sync_again_ms"] is None
    assert time["compute_ms"] > 0 and time["limiting_link"] in ("intra_node", "inter_node", None)


def test_fsdp_plan_model_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "resnet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fsdp-plan: error: model: unknown 'resnet'") and err.count("\n") == 1
    assert main(["--model", "demo", "--optimizer", "lion"]) == 2
    assert "optimizer: unknown optimizer 'lion'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_status:
        main(["--model", "demo", "--tflops", "0"])
    assert exit_status.value.code == 2 and "--tflops: expected a positive number" in capsys.readouterr().err


# -- fully_shard ---------------------------------------------------------------------------------


def test_fully_shards_trace_reduces_a_unit_once_its_inputs_gradients_are_done() -> None:
    """``fully_shard``'s post-backward waits for the unit's forward inputs' gradients too: the root
    (its inputs need none) reduces as soon as its own gradients arrived, before layer 1's
    pre-backward; layer 1 only after layer 0's pre-backward (the gradient of layer 0's output is
    layer 1's input's, hooked first by layer 0). Each takes its parameters' gradients: 1088 B per
    layer, 272 B for the root's 16 x 4 + 4."""
    with torch.device("meta"):
        model = net()
    prediction = predict_memory(
        model, step, world_size=2, auto_wrap_policy={Layer}, backend="gloo", api="fully_shard", backward_prefetch=None
    )
    hooks = [(p.at.event, p.at.unit) for p in prediction.trace.points if isinstance(p.at, HookEvent)]
    backward = hooks[hooks.index((Event.PRE_BACKWARD, 2)) :]
    assert backward == [
        (Event.PRE_BACKWARD, 2),
        (Event.POST_BACKWARD, 2),
        (Event.PRE_BACKWARD, 1),
        (Event.PRE_BACKWARD, 0),
        (Event.POST_BACKWARD, 1),
        (Event.POST_BACKWARD, 0),
        (Event.END_BACKWARD, -1),
    ]
    taken = {p.at.unit: p.taken for p in prediction.trace.points if p.taken and isinstance(p.at, HookEvent)}
    assert taken == {0: 1088, 1: 1088, 2: 272}
    assert prediction.api == "fully_shard" and prediction.fully_shard == PerUnitGathers(
        forward_reshards=(True, True, False)
    )


def silu_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 256), nn.SiLU(), nn.Linear(256, 8))


def silu_step(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(torch.randn(64, 8)).square().mean()
    return out


@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
def test_the_trace_counts_what_an_op_makes_not_the_flop_counters_decomposition(api: str) -> None:
    """``FlopCounterMode`` decomposes ops it has no count for (``silu_backward`` into seven, with
    temporaries of the op's size); the trace counts bytes above it, so only what the fused op
    makes, as the CPU holds when the model trains: the backward's highest autograd bytes equal
    those of a real backward of the same model measured by ``LiveBytes`` (its gradients
    included: autograd's until the post-backward takes them; the parameters left out, as FSDP's
    side counts them)."""
    model = silu_net()
    trace = predict_memory(model, silu_step, world_size=2, backend="gloo", api=api, backward_prefetch=None).trace
    marks = [p.at for p in trace.points]
    backward = trace.points[marks.index(Mark.BACKWARD_START) : marks.index(Mark.BACKWARD_END)]
    traced = max(max(p.peak, p.live) for p in backward)
    with LiveBytes() as live:
        live.ignore(model.parameters())
        loss = silu_step(model)
        with live.phase("backward"):
            torch.autograd.backward(loss)
    assert traced == live.peaks["backward"]


def test_hpz_gathers_backward_inside_a_node_for_memory() -> None:
    """16 ranks, 8 per node: with ``reshard_after_forward=8`` each block keeps 1/8 of its gathered
    parameters after forward (1088 / 8 B: the forward's peak holds layer 0's part) and
    backward gathers it over the node's 8 ranks (the intra-node link, each rank receiving 7/8 of
    the unit), where ``True`` gathers over all 16 across nodes; forward gathers across nodes both
    ways."""
    with torch.device("meta"):
        model = net()

    def predicted(reshard: bool | int) -> tuple[Prediction, set[tuple[Activity, Link | None]]]:
        p = predict_memory(
            model,
            step,
            world_size=16,
            auto_wrap_policy={Layer},
            backend="gloo",
            api="fully_shard",
            backward_prefetch=None,
            reshard_after_forward=reshard,
        )
        timeline = predict_time(p, flops_per_second=1e12, ranks_per_node=8).sync
        gathers = {(i.activity, i.link) for i in timeline.intervals if i.unit != 2 and i.group is not None}
        return p, {g for g in gathers if g[0] in (Activity.FORWARD_ALL_GATHER, Activity.BACKWARD_ALL_GATHER)}

    full, full_links = predicted(True)
    hpz, hpz_links = predicted(8)
    assert full_links == {
        (Activity.FORWARD_ALL_GATHER, Link.INTER_NODE),
        (Activity.BACKWARD_ALL_GATHER, Link.INTER_NODE),
    }
    assert hpz_links == {
        (Activity.FORWARD_ALL_GATHER, Link.INTER_NODE),
        (Activity.BACKWARD_ALL_GATHER, Link.INTRA_NODE),
    }
    forward = [m.phase_peak(Phase.FORWARD).breakdown[Category.PARAMS_UNSHARDED] for m in (full.worst, hpz.worst)]
    assert forward[1] - forward[0] == 1088 // 8, "layer 0's part while layer 1 gathers"
    with pytest.raises(ValueError, match="reshard_after_forward: expected a bool or a factor"):
        predict_memory(model, step, world_size=16, api="fully_shard", backward_prefetch=None, reshard_after_forward=3)
    with pytest.raises(ValueError, match="use_orig_params: fully_shard has no such option"):
        predict_memory(model, step, world_size=2, api="fully_shard", backward_prefetch=None, use_orig_params=True)
    with pytest.raises(ValueError, match="reshard_after_forward: only api='fully_shard'"):
        predict_memory(model, step, world_size=2, reshard_after_forward=2)
    with pytest.raises(ValueError, match="api: expected one of"):
        predict_memory(model, step, world_size=2, api="fsdp3")


def test_fsdp_plan_model_api_fully_shard(capsys: pytest.CaptureFixture[str]) -> None:
    """``--api fully_shard``: the header names it and its options; what it has no form of is one
    line on stderr naming the flag."""
    argv = [
        "--model",
        "llama-tiny",
        "--world-size",
        "4",
        "--backend",
        "gloo",
        "--batch-size",
        "2",
        "--api",
        "fully_shard",
    ]
    assert main([*argv, "--reshard-after-forward", "2", "--explicit-prefetch"]) == 0
    out = capsys.readouterr().out
    assert (
        "fully_shard on each block, then the root; reshard after forward: groups of 2 ranks; explicit prefetch" in out
    )
    assert "step time, modeled" in out
    assert main([*argv, "--use-orig-params"]) == 2
    assert "use_orig_params: fully_shard has no such option" in capsys.readouterr().err
    assert main([*argv, "--reshard-after-forward", "3"]) == 2
    assert (
        "reshard_after_forward: expected a bool or a factor of the shard group's size (4), got 3"
        in capsys.readouterr().err
    )
    assert main(["--model", "llama-tiny", "--explicit-prefetch"]) == 2
    assert "explicit_prefetch: only api='fully_shard' takes it" in capsys.readouterr().err


@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
def test_accumulating_without_no_sync_carries_reduced_shards(api: str) -> None:
    """``no_sync=False``: every backward reduces, so the second forward of a step starts with the
    first backward's reduced shards (half of each gradient on 2 ranks), where ``no_sync()`` keeps
    whole unsharded gradients; the step time is two synchronising iterations."""
    with torch.device("meta"):
        model = net()

    def carried(no_sync: bool) -> tuple[int, Prediction]:
        p = predict_memory(
            model,
            step,
            world_size=2,
            auto_wrap_policy={Layer},
            backend="gloo",
            api=api,
            backward_prefetch=None,
            accumulate=2,
            no_sync=no_sync,
        )
        second_forward = next(pk for pk in p.worst.peaks if pk.phase is Phase.FORWARD and pk.micro == 1)
        return second_forward.breakdown[Category.GRADS_CARRIED], p

    kept, _ = carried(True)
    shards, prediction = carried(False)
    assert 0 < shards < kept
    assert shards == (1088 + 1088 + 272) // 2
    time = predict_time(prediction, flops_per_second=1e12)
    assert time.no_sync is None and time.step_ms == pytest.approx(2 * time.sync.iteration_ms)
