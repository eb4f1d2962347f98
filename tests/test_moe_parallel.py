"""Expert parallelism equals one process: MoE layouts with the experts
folded over other ranks (EP, ETP), also over context-parallel ranks that
hold other positions of the same sequences, train as the serial model does.

One pool of four processes runs every layout in turn, and each process
computes the one-process reference once, so a layout costs its own steps
only. The model: E = 8 routed SwiGLU experts, top-2, a gated shared expert,
aux loss and z-loss with large coefficients (a wrong backward scale shows),
a dense first layer (a pipeline stage may hold no MoE layer), a loss mask
(--eod-mask-loss, see EOD). Tolerances are the dense tests' (test_ptdp_step):
losses, gradient norms and balancing losses rtol 1e-5, weights atol 1e-5
after STEPS AdamW steps with warm-up, clipping and weight decay (ADAM_EPS
below says why its eps is 1e-6).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.testing import assert_close

from ptdp.config import Config, DataConfig, ModelConfig
from ptdp.config.checks import validate
from ptdp.data.mock import MockGPTDataset
from ptdp.model.shapes import logical_shapes
from ptdp.parallel.sharding import SHARD_ATTR, gather_logical, shard_group
from ptdp.parallel.topology import ParallelContext, RankGrid
from ptdp.train.evaluate import evaluate
from ptdp.train.loop import Trainer
from tests import test_ptdp_step as step

CPU = torch.device("cpu")
STEPS = 3
# Microbatches of 1: at d = 2 two per replica (accumulated), at d = 4 one;
# at p = 2 enough for every schedule.
GLOBAL_BATCH = 4
# With eight experts some attention weights get gradients that cancel to
# about 1e-8, where Adam's default eps (1e-8) turns the layouts' rounding
# differences into 1e-5 of motion (observed 2e-5 to 8e-5 for layouts with and
# without expert parallelism alike, 6e-7 at d = 4 alone). At 1e-6 every
# layout stays under 5e-6 and every gradient above 1e-6 still gets Adam's
# full step.
ADAM_EPS = 1e-6

MOE = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                  vocab_size=100, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                  attention_dropout=0.0, swiglu=True, ffn_hidden_size=64, disable_bias_linear=True,
                  num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                  moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                  moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01,
                  moe_layer_freq="([0]+[1]*3)")
# Aux-loss-free balancing: sigmoid scores, expert biases moved 1e-2 a step
# (large, so that they change which experts are picked within the STEPS
# steps: the test holds it against biases that barely move, BIASED_STILL).
BIASED = dataclasses.replace(MOE, moe_router_score_function="sigmoid",
                             moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                             moe_aux_loss_coeff=0.0)
BIASED_STILL = dataclasses.replace(BIASED, moe_router_bias_update_rate=1e-9)
# A capacity factor: every layout routes each microbatch as one process does
# (ptdp.model.moe), so the same assignments are dropped.
CAPACITY = dataclasses.replace(MOE, moe_expert_capacity_factor=1.0)
# Megatron-Core's global_aux_loss: counts over the data-parallel replicas,
# averaged over the iteration's microbatches so far; at d = 1 every layout
# equals one process (at d > 1 the replicas' microbatches count together,
# which no one-process run does).
GLOBAL = dataclasses.replace(MOE, moe_router_load_balancing_type="global_aux_loss")
# The balancing loss per sequence: under context parallelism each sequence's
# counts come from every context rank.
SEQUENCE = dataclasses.replace(MOE, moe_router_load_balancing_type="seq_aux_loss")
MODELS = {"moe": MOE, "biased": BIASED, "biased-still": BIASED_STILL, "capacity": CAPACITY,
          "global": GLOBAL, "sequence": SEQUENCE}


@dataclasses.dataclass(frozen=True)
class Layout:
    t: int = 1
    p: int = 1
    d: int = 1
    c: int = 1                           # context-parallel size
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    k: int | None = None                 # layers per virtual stage (interleaved)
    recompute: str | None = None
    distributed: bool = False
    dispatcher: str = "allgather"
    grouped_gemm: bool = False
    per_token_loss: bool = False
    model: str = "moe"                   # a key of MODELS
    steps: int = STEPS
    strategy: str | None = None          # --use-megatron-fsdp's sharding strategy
    global_batch: int = GLOBAL_BATCH

    @property
    def name(self) -> str:
        parts = [f"t{self.t}p{self.p}d{self.d}" + f"c{self.c}" * (self.c > 1), f"ep{self.ep}",
                 f"etp{self.t if self.etp is None else self.etp}"]
        parts += ["sp"] * self.sequence_parallel + [self.schedule] * (self.p > 1)
        parts += [f"{self.recompute}-recompute"] * bool(self.recompute)
        parts += ["distopt"] * self.distributed + [self.dispatcher]
        parts += ["grouped"] * self.grouped_gemm + ["per-token"] * self.per_token_loss
        parts += [self.model] * (self.model != "moe") + [self.strategy] * bool(self.strategy)
        parts += [f"gb{self.global_batch}"] * (self.global_batch != GLOBAL_BATCH)
        return "-".join(parts)


def _config(layout: Layout | None = None) -> Config:
    layout = layout or Layout()
    model = MODELS[layout.model]  # a script's model may recompute on its own
    model = dataclasses.replace(model, recompute_granularity=layout.recompute
                                or model.recompute_granularity,
                                moe_token_dispatcher_type=layout.dispatcher,
                                moe_grouped_gemm=layout.grouped_gemm)
    config = step._config(layout.t, layout.p, layout.d, layout.k, model, layout.sequence_parallel,
                          use_distributed_optimizer=layout.distributed, adam_eps=ADAM_EPS,
                          calculate_per_token_loss=layout.per_token_loss,
                          global_batch_size=layout.global_batch)
    config.parallel = dataclasses.replace(
        config.parallel, pipeline_schedule="1f1b" if layout.schedule == "interleaved" else layout.schedule,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        context_parallel_size=layout.c)
    if layout.strategy:
        config.train = dataclasses.replace(config.train, use_megatron_fsdp=True,
                                           data_parallel_sharding_strategy=layout.strategy)
    config.data = DataConfig(mock_data=True, eod_mask_loss=True)
    validate(config, world_size=layout.t * layout.c * layout.p * layout.d)
    return config


def _most_frequent_token(model: ModelConfig = MOE, samples: int = 2 * GLOBAL_BATCH) -> int:
    data = MockGPTDataset(model.vocab_size, model.seq_length, step.TRAIN.seed)
    tokens = torch.cat([data[i][:-1] for i in range(samples)])
    return int(torch.bincount(tokens).argmax())


# Generated data has no documents: the most frequent input token of the first
# iterations' samples plays the end-of-document token, so that
# --eod-mask-loss leaves positions out of the loss.
EOD = _most_frequent_token()


def _trainer(config: Config, ctx: ParallelContext, **kwargs) -> Trainer:
    trainer = Trainer(config, ctx, CPU, **kwargs)
    trainer.data.eod = EOD if config.model.vocab_size == MOE.vocab_size and \
        config.model.seq_length == MOE.seq_length else _most_frequent_token(config.model)
    return trainer


def _logical_weights(trainer: Trainer, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """This rank's parameters as logical tensors (gathered over the group
    each is split over); a routed expert appears on its EP rank only."""
    return {name: gather_logical(param.detach().float().clone(), getattr(param, SHARD_ATTR, None),
                                 shard_group(param, ctx))
            for chunk in trainer.chunks for name, param in chunk.named_parameters()}


def _expert_biases(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for chunk in trainer.chunks
            for name, buffer in chunk.named_buffers() if name.endswith("expert_bias")}


_serial: dict[tuple[str, int, bool, int], tuple] = {}


def _one_process(model: str = "moe", steps: int = STEPS, per_token_loss: bool = False,
                 global_batch: int = GLOBAL_BATCH):
    """The reference run, once per process and settings: the records of
    `steps` + 1 iterations, and the weights and expert biases after `steps`."""
    key = model, steps, per_token_loss, global_batch
    if key not in _serial:
        trainer = _trainer(_config(Layout(model=model, per_token_loss=per_token_loss,
                                          global_batch=global_batch)),
                           ParallelContext.single())
        first, stats = trainer.step(0)
        masked = sum(stats.loss_tokens).item()
        # the loss mask leaves some out
        assert masked < trainer.global_batch * MODELS[model].seq_length
        records = [first] + [trainer.step(i)[0] for i in range(1, steps)]
        weights = _logical_weights(trainer, ParallelContext.single())
        biases = _expert_biases(trainer)
        validation = evaluate(trainer, trainer.data.valid, 1)["loss"]
        records.append(trainer.step(steps)[0])
        _serial[key] = records, weights, biases, validation
    return _serial[key]


def _layouts_vs_one_process(rank: int, layouts: list[Layout], models: dict | None = None,
                            references: dict | None = None) -> list[tuple[str, set, float]]:
    """Each layout in turn against the one-process run: (name, names of the
    weights this rank compared, the largest weight difference). `models`:
    more MODELS for the layouts to name (a Megatron-LM script's model).
    `references`: one-process runs the caller computed (_serial's entries)."""
    MODELS.update(models or {})
    _serial.update(references or {})
    results = []
    for layout in layouts:
        key = layout.model, layout.steps, layout.per_token_loss, layout.global_batch
        if key not in _serial:  # not given: rank 0 computes it for all (alike on every rank)
            _serial[key] = step.computed_once(lambda: _one_process(*key))
        expected, serial_weights, serial_biases, validation = _serial[key]
        if layout.model == "capacity":
            assert expected[0]["moe_dropped_fraction"] > 0.02  # the factor drops assignments
        grid = RankGrid(tp=layout.t, dp=layout.d, pp=layout.p, ep=layout.ep, etp=layout.etp,
                        cp=layout.c)
        ctx = ParallelContext.build(grid)
        trainer = _trainer(_config(layout), ctx)
        records = [trainer.step(i)[0] for i in range(layout.steps)]
        for got, want in zip(records, expected[:layout.steps]):
            assert not got["skipped"], layout.name
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), layout.name
            # Expert weights counted once over expert shards and replicas (--log-params-norm).
            assert got["params_norm"] == pytest.approx(want["params_norm"], rel=1e-6), layout.name
            for name in ("load_balancing_loss", "global_load_balancing_loss", "z_loss",
                         "moe_busiest_expert_share",
                         "moe_idlest_expert_share", "moe_dropped_fraction"):
                if name in want:
                    assert got[name] == pytest.approx(want[name], rel=1e-5), (layout.name, name)
            if trainer.holds_loss:
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), layout.name
        evaluated = evaluate(trainer, trainer.data.valid, 1)["loss"]  # forward only, dispatching
        if trainer.holds_loss:
            assert evaluated == pytest.approx(validation, rel=1e-5), layout.name
        worst, worst_name, compared = 0.0, None, set()
        # ZeRO-3 holds shards: the parameters whole while read, copied.
        with trainer.buffer.gathered() if layout.strategy else contextlib.nullcontext():
            logical = {n: w.clone() for n, w in _logical_weights(trainer, ctx).items()}
        for name, weight in logical.items():
            assert_close(weight, serial_weights[name], **step.WEIGHT_TOL,
                         msg=lambda m, name=name: f"{layout.name}: {name}: {m}")
            difference = (weight - serial_weights[name]).abs().max().item()
            if difference > worst:
                worst, worst_name = difference, name
            compared.add(name)
        for name, bias in _expert_biases(trainer).items():  # moved by ± the rate: exactly equal
            assert torch.equal(bias, serial_biases[name]), (layout.name, name)
            assert bias.abs().max() > 0
            compared.add(name)
        results.append((layout.name, compared, worst, worst_name))
        del trainer
        ctx.destroy()
    return results


# Four processes, every layout in one call. E = 8 experts: EP 4 holds 2 per rank.
LAYOUTS = [
    Layout(d=4, ep=4, dispatcher="alltoall"),                    # EP spanning d = 4
    Layout(d=4, ep=2, distributed=True, dispatcher="alltoall"),  # EDP 2, experts' state sharded
    Layout(t=2, d=2, ep=2, etp=2, sequence_parallel=True, recompute="selective",
           distributed=True),                                    # EP across d, ETP 2
    Layout(t=2, d=2, ep=2, etp=2, sequence_parallel=True, dispatcher="alltoall",
           grouped_gemm=True),
    # EP over t and d together, with a capacity factor: the same drops
    Layout(t=2, d=2, ep=4, etp=1, sequence_parallel=True, model="capacity", dispatcher="alltoall"),
    # p = 2, the first stage without an MoE layer; the balancing losses
    # weighed by tokens: stage 1 learns the batch's count from stage 2
    Layout(p=2, d=2, ep=2, per_token_loss=True),
    Layout(p=2, d=2, ep=2, schedule="interleaved", k=1, dispatcher="alltoall"),
    Layout(p=2, d=2, ep=2, schedule="zbv", distributed=True, dispatcher="alltoall",
           grouped_gemm=True, global_batch=8),                  # zbv: 2p microbatches
    # the expert biases after the steps (EP within the tensor group, ETP 1)
    Layout(t=2, d=2, ep=2, etp=1, sequence_parallel=True, model="biased", recompute="full"),
    Layout(p=2, d=2, ep=2, schedule="zb-h1", recompute="selective", grouped_gemm=True,
           model="biased"),
    Layout(t=2, p=2, ep=2, etp=1, sequence_parallel=True, model="global", recompute="full",
           dispatcher="alltoall"),
    # Context parallelism: experts folded over the context ranks
    Layout(c=2, d=2, ep=2, dispatcher="alltoall", distributed=True),
    Layout(c=2, d=2, ep=4, model="sequence", per_token_loss=True),
    Layout(t=2, c=2, ep=2, etp=1, sequence_parallel=True, model="biased",
           dispatcher="alltoall", recompute="selective"),
    Layout(c=2, p=2, ep=2, model="global", schedule="zb-h1", grouped_gemm=True),
]


def test_expert_parallel_layouts_train_like_one_process(pools):
    for layout in LAYOUTS:  # the references once, here, rather than on each of the four ranks
        _one_process(layout.model, layout.steps, layout.per_token_loss, layout.global_batch)
    # The biases move far enough within the steps to change which experts are picked.
    moving, still = ([r["moe_busiest_expert_share"] for r in _one_process(model)[0][:STEPS]]
                     for model in ("biased", "biased-still"))
    assert moving != still, (moving, still)
    per_rank = pools(4).run(_layouts_vs_one_process, LAYOUTS, None, dict(_serial))
    for i, layout in enumerate(LAYOUTS):
        every_name = set(logical_shapes(MODELS[layout.model]))
        if layout.model == "biased":
            every_name |= {f"layers.{n}.mlp.router.expert_bias" for n in (1, 2, 3)}
        compared = set().union(*(results[i][1] for results in per_rank))
        assert compared == every_name, layout.name  # every expert was held (and checked) somewhere
        worst = max(results[i][2] for results in per_rank)
        print(f"{layout.name}: largest weight difference {worst:.2e}")


def _resume_under_other_expert_layouts(rank: int, directory: str) -> list[float]:
    """Trained 2 iterations at EP = 4 (d = 4) and saved; resumed at EP = 2
    with t = 2 and sequence parallelism, then (rank 0) at one process: each
    resumed run's iterations 3 and 4 against the uninterrupted one-process
    run's. Returns the differences of the losses."""
    key = "moe", STEPS, False, GLOBAL_BATCH
    if key not in _serial:
        _serial[key] = step.computed_once(lambda: _one_process(*key))
    expected = _serial[key][0]
    saved_at = 2
    layouts = [Layout(d=4, ep=4, dispatcher="alltoall"),
               Layout(t=2, d=2, ep=2, etp=1, sequence_parallel=True)]
    ctx = ParallelContext.build(RankGrid(tp=1, dp=4, pp=1, ep=4, etp=1))
    trainer = _trainer(_config(layouts[0]), ctx)
    for i in range(saved_at):
        trainer.step(i)
    checkpoint = trainer.save(directory, saved_at)
    start = (saved_at, trainer.consumed_before(saved_at))
    del trainer
    ctx.destroy()
    differences = []
    resumed_layouts = [(layouts[1], RankGrid(tp=2, dp=2, pp=1, ep=2, etp=1)),
                       (Layout(), RankGrid(1, 1, 1) if rank == 0 else None)]
    for layout, grid in resumed_layouts:
        ctx = ParallelContext.single() if grid == RankGrid(1, 1, 1) else \
            ParallelContext.build(grid) if grid is not None else None
        if ctx is None:
            continue
        trainer = _trainer(_config(layout), ctx, start=start)
        trainer.load(str(checkpoint))
        for i in range(saved_at, STEPS + 1):
            record = trainer.step(i)[0]
            if trainer.holds_loss:
                assert record["loss"] == pytest.approx(expected[i]["loss"], rel=1e-5), layout.name
                differences.append(abs(record["loss"] - expected[i]["loss"]))
    return differences


def test_a_checkpoint_resumes_under_other_expert_layouts(pools, tmp_path):
    differences = pools(4).run(_resume_under_other_expert_layouts, str(tmp_path / "ckpt"))
    assert len(differences[0]) == 4 and all(len(d) == 2 for d in differences[1:])
    print(f"largest loss difference after resuming: {max(max(d) for d in differences):.2e}")
