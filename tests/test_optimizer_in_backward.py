"""optimizer_in_backward: bitwise parity with the plain run (plain module, DDP, FSDP2),
gradients freed during backward, the Optimizer contract, clipping, errors.

Plain modules run in this process. DDP and FSDP2 run in one spawned run of 2 gloo ranks
(``optimizer_in_backward_ranks.two_rank_scenarios``) whose per-rank results the tests
assert on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import FailsInBackward, compare, failures, on_each_real_step, values
from optimizer_in_backward_ranks import OPTIMIZERS, STEPS, two_rank_scenarios
from torch import nn

import overlapkit
from overlapkit.distributed import run_distributed

# importing torch.distributed.optim (torch's own optimizer in backward) scripts its
# functional optimizers, which warns on torch 2.13
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")

#: plain-module parity: OPTIMIZERS plus a few more
PLAIN_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    **OPTIMIZERS,
    "Adam-foreach-amsgrad": (torch.optim.Adam, {"lr": 0.01, "foreach": True, "amsgrad": True}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.01}),
    "RMSprop-centered": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
}


class Tied(nn.Module):
    """An MLP whose first and last layers share one weight matrix (used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _model() -> Tied:
    torch.manual_seed(0)
    return Tied()


def _batches(count: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=generator) for _ in range(count)]


def _train(model: nn.Module, opt: Any, batches: list[torch.Tensor], *,
           before_step: Callable[[], None] | None = None, scheduler: Any = None,
           accumulate: int = 1) -> list[bool]:
    """Train; return, per step, whether every parameter's grad was None after backward."""
    grads_none = []
    for i, x in enumerate(batches):
        boundary = (i + 1) % accumulate == 0
        if boundary or not isinstance(opt, overlapkit.OptimizerInBackward):
            model(x).square().mean().backward()
        else:
            with opt.no_step():
                model(x).square().mean().backward()
        if not boundary:
            continue
        grads_none.append(all(p.grad is None for p in model.parameters()))
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return grads_none


def _parity(optim_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
            plain_before_step: Callable[[nn.Module], None] | None = None,
            oib_options: dict[str, Any] | None = None, **train: Any
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    model = _model()
    opt = overlapkit.optimizer_in_backward(model, optim_cls, **kwargs, **(oib_options or {}))
    grads_none = _train(model, opt, _batches(STEPS * train.get("accumulate", 1)), **train)
    plain_model = _model()
    plain = optim_cls(plain_model.parameters(), **kwargs)
    hook = None if plain_before_step is None else (lambda: plain_before_step(plain_model))
    _train(plain_model, plain, _batches(STEPS * train.get("accumulate", 1)),
           before_step=hook, **train)
    return values(model), values(plain_model), grads_none


# -- plain module, in this process ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PLAIN_OPTIMIZERS))
def test_plain_module_bitwise_parity_and_grads_freed(name: str) -> None:
    optim_cls, kwargs = PLAIN_OPTIMIZERS[name]
    ours, plain, grads_none = _parity(optim_cls, kwargs)
    assert not compare(ours, values(_model())), "nothing was stepped"
    assert compare(ours, plain)
    assert all(grads_none) and len(grads_none) == STEPS


def test_a_parameter_used_twice_is_stepped_once_with_its_whole_gradient() -> None:
    # Tied uses inp.weight twice; a step per contribution would differ from plain, and
    # would count two steps in Adam's state.
    model, plain_model = _model(), _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.1)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.1)
    x = _batches(1)[0]
    model(x).square().mean().backward()
    plain_model(x).square().mean().backward()
    plain.step()
    steps = [float(opt.optimizer.state[p]["step"]) for p in model.parameters()]
    assert steps == [1.0] * 5
    assert compare(values(model), values(plain_model))


def test_lr_scheduler_drives_it() -> None:
    model = _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    _train(model, opt, _batches(STEPS), scheduler=sched)
    _train(plain_model, plain, _batches(STEPS), scheduler=plain_sched)
    assert opt.param_groups[0]["lr"] == 0.01 * 0.5 ** (STEPS // 2)
    assert compare(values(model), values(plain_model))


def test_step_is_a_noop_after_a_stepping_backward_and_a_plain_step_otherwise() -> None:
    model = _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.01)
    assert isinstance(opt, torch.optim.Optimizer) and opt.kind == "module"
    before = values(model)
    model(_batches(1)[0]).square().mean().backward()
    after_backward = values(model)
    opt.step()
    assert not compare(before, after_backward)
    assert compare(after_backward, values(model))
    # gradients set by hand, no backward: step() is the plain optimizer's step
    reference = torch.optim.Adam(_model().parameters(), lr=0.01)
    reference.load_state_dict(copy.deepcopy(opt.state_dict()))
    ref_params = [p for group in reference.param_groups for p in group["params"]]
    with torch.no_grad():
        for mine, ref in zip(model.parameters(), ref_params, strict=True):
            ref.copy_(mine)
            mine.grad = torch.full_like(mine, 0.5)
            ref.grad = torch.full_like(ref, 0.5)
    opt.step()
    reference.step()
    assert compare(values(model), [p.detach() for p in ref_params])
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_no_step_accumulates_like_plain_accumulation() -> None:
    ours, plain, grads_none = _parity(torch.optim.AdamW, {"lr": 0.01}, accumulate=3)
    assert compare(ours, plain) and all(grads_none)


def test_state_dict_loads_into_a_plain_optimizer_and_back() -> None:
    batches = _batches(6)
    model = _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.Adam, lr=0.01)
    _train(model, opt, batches[:3])
    plain_model = _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01)
    _train(plain_model, plain, batches[:3])
    assert compare(values(model), values(plain_model))
    ours_state, plain_state = opt.state_dict(), plain.state_dict()
    assert ours_state["param_groups"] == plain_state["param_groups"]
    assert all(torch.equal(ours_state["state"][k][s], plain_state["state"][k][s])
               for k in plain_state["state"] for s in plain_state["state"][k])

    def resume(state: dict[str, Any], in_backward: bool) -> list[torch.Tensor]:
        fresh = _model()
        with torch.no_grad():
            for p, v in zip(fresh.parameters(), values(model), strict=True):
                p.copy_(v)
        fresh_opt: Any = (overlapkit.optimizer_in_backward(fresh, torch.optim.Adam, lr=0.01)
                          if in_backward else torch.optim.Adam(fresh.parameters(), lr=0.01))
        fresh_opt.load_state_dict(copy.deepcopy(state))
        _train(fresh, fresh_opt, batches[3:])
        return values(fresh)

    reference = resume(plain_state, False)
    assert compare(resume(ours_state, False), reference)  # ours -> plain
    assert compare(resume(plain_state, True), reference)  # plain -> ours


def test_value_clipping_is_exact() -> None:
    def clip(model: nn.Module) -> None:
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)

    ours, plain, _ = _parity(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, clip,
                             {"clip_grad_value": 0.01})
    assert compare(ours, plain)


def test_bucket_scope_norm_clipping_is_per_parameter_not_global() -> None:
    def per_parameter(model: nn.Module) -> None:
        for p in model.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.05)

    def global_norm(model: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    options = {"clip_grad_norm": 0.05, "clip_grad_norm_scope": "bucket"}
    ours, plain, _ = _parity(torch.optim.SGD, {"lr": 0.1}, per_parameter, options)
    assert compare(ours, plain)
    ours, plain, _ = _parity(torch.optim.SGD, {"lr": 0.1}, global_norm, options)
    assert not compare(ours, plain)


@pytest.mark.parametrize(("optim_cls", "kwargs"), [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.01})])
def test_default_norm_clipping_is_torchs_global_clip_grad_norm(
        optim_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> None:
    norms: list[float] = []

    def global_norm(model: nn.Module) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))

    ours, plain, grads_none = _parity(optim_cls, kwargs, global_norm, {"clip_grad_norm": 0.05})
    assert compare(ours, plain)
    assert min(norms) > 0.05  # clipping was active at every step
    assert all(grads_none)  # freed after the step at the end of backward


def test_two_calls_on_disjoint_parameters_act_as_two_plain_optimizers() -> None:
    def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        named = list(model.named_parameters())
        return ([p for n, p in named if n.endswith("weight")],
                [p for n, p in named if n.endswith("bias")])

    model = _model()
    weights, biases = split(model)
    first = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, params=weights, lr=0.01)
    second = overlapkit.optimizer_in_backward(model, torch.optim.SGD, params=biases, lr=0.1)
    plain_model = _model()
    plain_weights, plain_biases = split(plain_model)
    plain_first = torch.optim.AdamW(plain_weights, lr=0.01)
    plain_second = torch.optim.SGD(plain_biases, lr=0.1)
    for x in _batches(STEPS):
        model(x).square().mean().backward()
        plain_model(x).square().mean().backward()
        for opt in (first, second, plain_first, plain_second):
            opt.step()
            opt.zero_grad()
    assert compare(values(model), values(plain_model))


def test_same_result_as_torchs_apply_optimizer_in_backward() -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    ours, _, _ = _parity(torch.optim.AdamW, {"lr": 0.01})
    model = _model()
    _apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": 0.01})
    for x in _batches(STEPS):
        model(x).square().mean().backward()
    assert compare(ours, values(model))


def test_param_groups_given_as_generators_are_trained() -> None:
    model, plain_model = _model(), _model()
    opt = overlapkit.optimizer_in_backward(
        model, torch.optim.SGD, params=[{"params": model.mid.parameters(), "lr": 0.2}],
        lr=0.1)
    opt.add_param_group({"params": model.inp.parameters()})
    plain = torch.optim.SGD([{"params": plain_model.mid.parameters(), "lr": 0.2},
                             {"params": plain_model.inp.parameters()}], lr=0.1)
    for x in _batches(3):
        for m, o in ((model, opt), (plain_model, plain)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert compare(values(model), values(plain_model))
    assert model.mid.weight.grad is None and model.inp.bias.grad is None
    assert model.out.bias.grad is not None  # not in the optimizer: left alone


def test_a_backward_that_raised_does_not_break_the_next_ones() -> None:
    """After a backward that raised once some parameters had stepped, the next
    backwards still step with plain results, and step() after them is still a no-op
    (not a second, full step of the real optimizer)."""
    model, plain_model = _model(), _model()
    opt = overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    x = _batches(1)[0]
    # out and mid have stepped when the function below them raises
    hidden = FailsInBackward.apply(torch.tanh(model.inp(x)))
    with pytest.raises(RuntimeError, match="simulated"):
        model.out(torch.tanh(model.mid(hidden))).square().mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    calls: list[int] = []
    on_each_real_step(opt, lambda _: calls.append(1))
    full_steps_by_step = []
    for batch in _batches(3, seed=2):
        model(batch).square().mean().backward()
        before = len(calls)
        opt.step()
        full_steps_by_step.append(len(calls) - before)
        opt.zero_grad()
        plain_model(batch).square().mean().backward()
        plain.step()
        plain.zero_grad()
    assert full_steps_by_step == [0, 0, 0]
    assert compare(values(model), values(plain_model))


# -- errors ----------------------------------------------------------------------------


def _frozen() -> nn.Module:
    model = nn.Linear(2, 2)
    model.requires_grad_(False)
    return model


def _claimed_by_torch() -> nn.Module:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = nn.Linear(2, 2)
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    return model


def _twice() -> None:
    model = nn.Linear(2, 2)
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, lr=0.1)
    # a part of its parameters (all of them: replaced, tests/test_rebuild.py)
    overlapkit.optimizer_in_backward(model, torch.optim.SGD, params=[model.bias], lr=0.1)


def _closure() -> None:
    opt = overlapkit.optimizer_in_backward(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)
    opt.step(lambda: 0.0)


ERRORS: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "no trainable parameters": (
        lambda: overlapkit.optimizer_in_backward(_frozen(), torch.optim.SGD, lr=0.1),
        overlapkit.ConfigurationError, "no parameter with requires_grad=True"),
    "registered twice": (_twice, overlapkit.ConfigurationError, "covers only part of"),
    "after torch's own": (
        lambda: overlapkit.optimizer_in_backward(_claimed_by_torch(), torch.optim.SGD, lr=0.1),
        overlapkit.ConfigurationError, "_apply_optimizer_in_backward"),
    "LBFGS": (lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), torch.optim.LBFGS),
              overlapkit.UnsupportedOptimizerError, "closure"),
    "SparseAdam": (
        lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), torch.optim.SparseAdam),
        overlapkit.UnsupportedOptimizerError, "sparse gradients"),
    "not an optimizer": (
        lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), nn.Linear),
        overlapkit.UnsupportedOptimizerError, "optimizer class itself"),
    "not a module": (
        lambda: overlapkit.optimizer_in_backward(object(), torch.optim.SGD),  # type: ignore[arg-type]
        overlapkit.UnsupportedModelError, "needs a torch.nn.Module"),
    "params not in the module": (
        lambda: overlapkit.optimizer_in_backward(
            nn.Linear(2, 2), torch.optim.SGD, params=[nn.Parameter(torch.ones(2))], lr=0.1),
        overlapkit.ConfigurationError, "not a parameter of the module"),
    "comm hook on a plain module": (
        lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), torch.optim.SGD, lr=0.1,
                                                 comm_hook="fp16_compress"),
        overlapkit.ConfigurationError, "DistributedDataParallel models only"),
    "bad clip": (
        lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), torch.optim.SGD, lr=0.1,
                                                 clip_grad_value=0),
        overlapkit.ConfigurationError, "clip_grad_value must be a positive"),
    "bad optimizer argument": (
        lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), torch.optim.SGD, lr=-1.0),
        overlapkit.ConfigurationError, "Fix the optimizer arguments"),
    "closure": (_closure, overlapkit.ConfigurationError, "takes no closure"),
    "ZeroRedundancyOptimizer": (
        lambda: overlapkit.optimizer_in_backward(nn.Linear(2, 2), _zero_redundancy()),
        overlapkit.UnsupportedOptimizerError, "distributed wrapper"),
}


def test_sparse_adam_refusal_on_a_plain_module_names_no_ddp() -> None:
    # 968cf42: "SparseAdam needs sparse gradients, and DDP buckets hold dense ones" on a
    # plain module, where no DDP bucket is involved
    model = nn.Embedding(10, 4, sparse=True)
    with pytest.raises(overlapkit.UnsupportedOptimizerError) as refused:
        overlapkit.optimizer_in_backward(model, torch.optim.SparseAdam, lr=0.1)
    message = str(refused.value)
    assert "DDP buckets hold" not in message
    assert "steps during backward take dense ones, on any model" in message
    assert "SparseAdam in a plain loop" in message


def _zero_redundancy() -> type[torch.optim.Optimizer]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_input_gets_an_overlapkit_error_saying_what_to_do(case: str) -> None:
    call, error, text = ERRORS[case]
    with pytest.raises(error, match=text):
        call()


# -- DDP and FSDP2 on 2 gloo ranks --------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("oib")
    return run_distributed(two_rank_scenarios, 2, args=(str(directory),), timeout=240)


def _check_parity(results: list[dict[str, Any]], key: str, lr: float | None = None) -> None:
    for rank_results in results:
        result = rank_results[key]
        assert result["moved"], f"{key}: nothing was stepped"
        assert result["equal"], f"{key}: differs from the plain run"
        assert result["grads_none"], f"{key}: gradients left after backward"
        if lr is not None:
            assert result["lr"] == result["plain_lr"] == lr * 0.5 ** (STEPS // 2)


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_ddp_bitwise_parity_grads_freed_and_scheduler(
    two_ranks: list[dict[str, Any]], name: str, as_view: bool
) -> None:
    _check_parity(two_ranks, f"ddp {name} bucket_view={as_view}", OPTIMIZERS[name][1]["lr"])


@pytest.mark.parametrize("scenario", ["unused", "static_graph", "fp16_compress", "no_step"])
def test_ddp_parity_with_unused_parameters_a_comm_hook_and_accumulation(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    _check_parity(two_ranks, f"ddp {scenario}")


def test_ddp_param_groups_given_as_generators_are_trained(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert failures(two_ranks, "ddp generator group") == {}


def test_ddp_a_refused_comm_hook_leaves_no_parameter_hooks(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert failures(two_ranks, "ddp refused hook keeps grads") == {}


def test_ddp_value_clipping_is_exact(two_ranks: list[dict[str, Any]]) -> None:
    assert failures(two_ranks, "ddp clip_value") == {}


def test_ddp_parameters_outside_params_keep_their_gradients(
    two_ranks: list[dict[str, Any]],
) -> None:
    assert failures(two_ranks, "ddp others keep grads") == {}


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_state_dict_loads_into_a_plain_optimizer(two_ranks: list[dict[str, Any]],
                                                 kind: str) -> None:
    assert failures(two_ranks, f"{kind} state_dict") == {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fsdp2_bitwise_parity_grads_freed_and_scheduler(
    two_ranks: list[dict[str, Any]], name: str
) -> None:
    assert two_ranks[0][f"fsdp2 {name}"]["kind"] == "fsdp2"
    _check_parity(two_ranks, f"fsdp2 {name}", OPTIMIZERS[name][1]["lr"])


@pytest.mark.parametrize("scenario", ["no_step", "clip_value", "clip_norm per parameter",
                                      "clip_norm global"])
def test_fsdp2_parity_with_accumulation_and_clipping(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    _check_parity(two_ranks, f"fsdp2 {scenario}")


def test_fsdp2_bucket_scope_norm_clipping_is_not_global(
        two_ranks: list[dict[str, Any]]) -> None:
    """clip_grad_norm_scope='bucket' clips each parameter by its own norm: not the
    global result (so the clipping in these scenarios is active)."""
    assert not any(r["fsdp2 clip_norm not global"]["equal"] for r in two_ranks)


def test_fsdp2_checkpoint_save_and_load_round_trip(two_ranks: list[dict[str, Any]]) -> None:
    for rank_results in two_ranks:
        result = rank_results["fsdp2 checkpoint"]
        assert result["state_equal"]
        assert result["continues"], result["continues"]


DISTRIBUTED_ERRORS = {
    "ddp twice": ("ConfigurationError", "covers only part of the parameters"),
    "ddp after overlap_ddp": ("ConfigurationError", "choose one of overlap_ddp and"),
    "overlap_ddp after ddp": ("ConfigurationError", "choose one of overlap_ddp and"),
    "overlap_ddp over a module in backward": ("ConfigurationError", "already stepped during"),
    "ddp params not in model": ("ConfigurationError", "not a parameter of the DDP model"),
    "ddp unknown comm hook": ("UnknownNameError", "'allreduce', 'bf16_compress'"),
    "ddp clip norm with unused": ("ConfigurationError", "default clip_grad_norm_scope='global'"),
    "ddp refused hook": ("ConfigurationError", "DDP refused the comm hook"),
    "fsdp2 twice": ("ConfigurationError", "covers only part of the parameters"),
    "fsdp2 comm_hook": ("ConfigurationError", "DistributedDataParallel models only"),
}


@pytest.mark.parametrize("case", sorted(DISTRIBUTED_ERRORS))
def test_distributed_bad_input_gets_an_overlapkit_error(
    two_ranks: list[dict[str, Any]], case: str
) -> None:
    expected_type, expected_text = DISTRIBUTED_ERRORS[case]
    for rank_results in two_ranks:
        error = rank_results[case]
        assert error is not None, f"{case}: no error raised"
        assert error["overlapkit"] and error["type"] == expected_type, error
        assert expected_text in error["message"], error
        assert ".." not in error["message"], error  # torch's own full stop kept once


# -- CUDA (skipped without a GPU) ------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_steps_run_on_a_side_stream_with_bitwise_parity() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).to(device)
    plain_model = copy.deepcopy(model)
    opt = overlapkit.optimizer_in_backward(model, torch.optim.AdamW, lr=0.01)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01)
    streams: list[int] = []
    on_each_real_step(opt, lambda _: streams.append(torch.cuda.current_stream().stream_id))
    default_stream = torch.cuda.current_stream().stream_id
    generator = torch.Generator(device=device).manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(32, 64, device=device, generator=generator)
        model(x).square().mean().backward()
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        plain_model(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
    torch.cuda.synchronize()
    assert streams and all(s != default_stream for s in streams)
    assert compare(values(model), values(plain_model))


def _cuda_ddp_rank(rank: int, world_size: int) -> bool:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", 0)

    def build() -> DDP:
        torch.manual_seed(0)
        return DDP(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)).to(device),
                   bucket_cap_mb=0.05)

    ours, reference = build(), build()
    opt = overlapkit.optimizer_in_backward(ours, torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    generator = torch.Generator(device=device).manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(32, 64, device=device, generator=generator)
        ours(x).square().mean().backward()
        opt.step()
        reference(x).square().mean().backward()
        plain.step()
        plain.zero_grad()
    torch.cuda.synchronize()
    return compare(values(ours.module), values(reference.module))


@pytest.mark.cuda
@cuda
def test_cuda_ddp_bitwise_parity() -> None:
    assert all(run_distributed(_cuda_ddp_rank, 1))
