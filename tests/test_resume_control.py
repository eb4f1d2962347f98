"""What --load takes: --finetune (the weights only, a new run from iteration
0), --no-load-optim (a fresh optimizer and learning-rate schedule, the
iteration goes on), --no-load-rng (--seed's streams) and
--use-checkpoint-args (the model's settings from the checkpoint), each as
Megatron-LM's load_checkpoint / load_args_from_checkpoint."""

import dataclasses
import json

import pytest
import torch

from ptdp.cli import build_parser, main
from ptdp.commands.train import config_from_settings, settings_from_args
from ptdp.config import ConfigError, ModelConfig, validate
from ptdp.parallel.topology import ParallelContext
from ptdp.checkpoint.store import FINETUNED_FROM, check_model_fits, read_metadata, resolve
from ptdp.checkpoint.args import changed_settings_note, with_checkpoint_shape
from ptdp.train.loop import Trainer
from ptdp.checkpoint.retention import LINEAGE
from tests.test_checkpoint import CPU, MODEL, _config

DROPOUT = dataclasses.replace(MODEL, hidden_dropout=0.1, attention_dropout=0.1)
STOP = 3  # the pretraining run saves after this iteration


def _single():
    return ParallelContext.single()


def _pretrain(save, model=MODEL, **train):
    """STOP iterations of a run, saved: (the trainer, the checkpoint directory)."""
    trainer = Trainer(_config(model=model, **train), _single(), CPU)
    for i in range(STOP):
        trainer.step(i)
    return trainer, trainer.save(str(save), STOP)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The pretraining run (dropout on, so random states matter) and its checkpoint."""
    save = tmp_path_factory.mktemp("pretrained") / "ckpt"
    trainer, _ = _pretrain(save, model=DROPOUT)
    return trainer, save, trainer.chunks[0].rng.get_states()


def _loaded(checkpoint, model=DROPOUT, **train):
    """A new trainer that loads `checkpoint`, started where the training loop starts it."""
    config = _config(model=model, load=str(checkpoint), **train)
    metadata = read_metadata(resolve(checkpoint))
    start = (0, 0) if config.train.finetune else (metadata["iteration"],
                                                  metadata["consumed_samples"])
    trainer = Trainer(config, _single(), CPU, start=start)
    trainer.load(str(checkpoint))
    return trainer


def _same_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fresh_states() -> dict:
    """The random streams of a fresh run at its start (after building its model)."""
    return Trainer(_config(model=DROPOUT), _single(), CPU).chunks[0].rng.get_states()


# --------------------------------------------------------------------------- --finetune

def test_finetune_takes_the_weights_and_starts_a_run_of_its_own(pretrained):
    source, save, saved_states = pretrained
    tuned = _loaded(save, finetune=True)
    assert torch.equal(tuned.buffer.param_data, source.buffer.param_data)
    assert tuned.optimizer.steps == 0 and not tuned.optimizer.exp_avg.any() \
        and not tuned.optimizer.exp_avg_sq.any()
    lineage = tuned.checkpoint_lineage
    assert lineage.inherited == [] and lineage.forked_at == 0
    # The random streams are --seed's at a fresh start, not the checkpoint's.
    states = tuned.chunks[0].rng.get_states()
    assert _same_states(states, _fresh_states()) and not _same_states(states, saved_states)
    # Its first iteration is a fresh run's first with the loaded weights: the
    # same batch, loss, learning rate (the schedule's first) and, with Adam
    # starting afresh, the same update.
    reference = Trainer(_config(model=DROPOUT), _single(), CPU)
    with torch.no_grad():
        reference.buffer.param_data.copy_(source.buffer.param_data)
    tuned.chunks[0].rng.set_states(states)
    got = tuned.step(0)[0]
    reference.chunks[0].rng.set_states(states)
    want = reference.step(0)[0]
    assert (got["iteration"], got["consumed_samples"]) == (1, 8)
    assert got["loss"] == want["loss"] and got["lr"] == want["lr"] == reference.learning_rate()
    assert torch.equal(tuned.buffer.param_data, reference.buffer.param_data)
    assert torch.equal(tuned.optimizer.exp_avg, reference.optimizer.exp_avg)


def test_finetune_saves_a_lineage_of_its_own(pretrained, tmp_path):
    """Its checkpoints record where they came from but never continue the
    loaded run's lineage; --keep-last prunes only its own, and the loaded
    directory is never touched."""
    _, save, _ = pretrained
    before = sorted(p.name for p in save.iterdir())
    tuned = _loaded(save, finetune=True, keep_last=1, save=str(tmp_path / "ft"))
    for i in range(2):
        tuned.step(i)
        tuned.save(str(tmp_path / "ft"), i + 1)
    assert sorted(p.name for p in (tmp_path / "ft").iterdir()) == ["iter_0000002", "latest"]
    assert sorted(p.name for p in save.iterdir()) == before
    metadata = read_metadata(resolve(tmp_path / "ft"))
    loaded = read_metadata(resolve(save))
    assert metadata["iteration"] == 2 and len(metadata[LINEAGE]) == 1
    assert metadata[LINEAGE][0][0] not in {run for run, _ in loaded[LINEAGE]}
    assert metadata[FINETUNED_FROM] == {"checkpoint": str(resolve(save).absolute()),
                                        "iteration": STOP, LINEAGE: loaded[LINEAGE]}
    # Resuming the fine-tune (no --finetune) continues its lineage and keeps the record.
    resumed = _loaded(tmp_path / "ft")
    assert resumed.checkpoint_lineage.inherited == metadata[LINEAGE]
    assert resumed.finetuned_from == metadata[FINETUNED_FROM]


def test_finetune_into_the_loaded_directory_is_refused(tmp_path):
    """--save == the loaded checkpoint's directory: its iter_* names and
    `latest` would be taken over, the loaded run's checkpoints moved away."""
    save = tmp_path / "ckpt"
    for load in (save, save / "iter_0000003"):
        config = _config(finetune=True, load=str(load), save=str(save))
        with pytest.raises(ConfigError, match="give the fine-tune another --save directory"):
            validate(config)
    validate(_config(finetune=True, load=str(save), save=str(tmp_path / "ft")))
    validate(_config(load=str(save), save=str(save)))  # a resume: fine


def test_each_needs_load():
    for flags, name in (({"finetune": True}, "--finetune"),
                        ({"use_checkpoint_args": True}, "--use-checkpoint-args")):
        with pytest.raises(ConfigError, match=f"{name} needs --load DIR") as caught:
            validate(_config(**flags))
        assert len(caught.value.problems) == 1
    # what leaves something out of a checkpoint has nothing to leave out of
    # none: a note, as Megatron-LM accepts them (tests/test_megatron_flags.py)
    validate(_config(load_optim=False, load_rng=False))
    # with --finetune the other two are implied, and fine to give
    validate(_config(finetune=True, load_optim=False, load_rng=False, load="somewhere"))


# --------------------------------------------------------------------------- --no-load-optim

def test_no_load_optim_restarts_adam_and_the_schedule(pretrained):
    source, save, _ = pretrained
    resumed = _loaded(save, load_optim=False)
    assert torch.equal(resumed.buffer.param_data, source.buffer.param_data)
    assert resumed.optimizer.steps == 0 and not resumed.optimizer.exp_avg.any() \
        and not resumed.optimizer.exp_avg_sq.any()
    assert source.optimizer.exp_avg.any()  # (there was state to leave out)
    assert resumed.checkpoint_lineage.forked_at == STOP  # the same run, continued
    # The iteration and the data position continue; the learning rate is the
    # schedule's from its start (Megatron-LM skips the scheduler's state too).
    fresh = Trainer(_config(model=DROPOUT), _single(), CPU)
    assert resumed.lr_steps == fresh.lr_steps == 0 and source.lr_steps == 8 * STOP
    record = resumed.step(STOP)[0]
    assert (record["iteration"], record["consumed_samples"]) == (STOP + 1, 8 * (STOP + 1))
    assert record["lr"] == fresh.step(0)[0]["lr"] != source.learning_rate()
    assert resumed.lr_steps == fresh.lr_steps == 8
    resumed.load(str(save))  # again, into a trainer that has stepped: Adam afresh all the same
    assert resumed.optimizer.steps == 0 and not resumed.optimizer.exp_avg.any()
    assert resumed.lr_steps == 0
    full = _loaded(save)
    assert full.optimizer.steps == STOP and full.lr_steps == source.lr_steps
    assert full.learning_rate() == source.learning_rate()


def test_no_load_optim_keeps_the_fp32_main_weights_and_a_fresh_loss_scale(tmp_path):
    """fp16: the main weights are the checkpoint's exact fp32 ones, the loss
    scaler starts at --initial-loss-scale."""
    source = Trainer(_config(fp16=True), _single(), CPU)
    source.step(0)
    source.optimizer.scaler.scale = 1024.0  # as after overflows
    source.save(str(tmp_path), 1)
    full = _loaded(tmp_path, model=MODEL, fp16=True)
    assert full.optimizer.scaler.scale == 1024.0
    for flags in ({"load_optim": False}, {"finetune": True}):
        resumed = _loaded(tmp_path, model=MODEL, fp16=True, **flags)
        assert resumed.optimizer.scaler.scale == 2.0 ** 32
        assert torch.equal(resumed.optimizer.main, source.optimizer.main)
        assert torch.equal(resumed.buffer.param_data, source.buffer.param_data)
        assert not resumed.optimizer.exp_avg.any() and resumed.optimizer.steps == 0


# --------------------------------------------------------------------------- --no-load-rng

def test_no_load_rng_draws_from_the_seeds_streams(pretrained):
    source, save, saved_states = pretrained
    full = _loaded(save)
    assert _same_states(full.chunks[0].rng.get_states(), saved_states)
    resumed = _loaded(save, load_rng=False)
    states = resumed.chunks[0].rng.get_states()
    assert _same_states(states, _fresh_states()) and not _same_states(states, saved_states)
    # Everything else resumes: the optimizer, the schedule, the iteration.
    assert torch.equal(resumed.optimizer.exp_avg, full.optimizer.exp_avg)
    assert resumed.optimizer.steps == STOP and resumed.lr_steps == source.lr_steps == 8 * STOP
    # So the dropout masks differ from a full resume's, and with them the loss.
    full.chunks[0].rng.set_states(saved_states)
    assert resumed.step(STOP)[0]["loss"] != full.step(STOP)[0]["loss"]


# --------------------------------------------------------------------------- --use-checkpoint-args

LLAMA = ModelConfig(num_layers=8, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                    num_query_groups=2, ffn_hidden_size=48, seq_length=16, vocab_size=100,
                    make_vocab_size_divisible_by=8, hidden_dropout=0.0, attention_dropout=0.0,
                    normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
                    position_embedding_type="rope", rotary_base=500000.0,
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                    apply_layernorm_1p=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    save = tmp_path_factory.mktemp("llama") / "ckpt"
    trainer = Trainer(_config(model=LLAMA), _single(), CPU)
    trainer.step(0)
    trainer.save(str(save), 1)
    return save


def _resolved(*argv):
    """The configuration `ptdp train ARGV` runs with, up to the checkpoint's settings."""
    settings = settings_from_args(build_parser().parse_args(["train", *argv]))
    return with_checkpoint_shape(config_from_settings(settings), list(settings))


def test_use_checkpoint_args_builds_the_checkpoints_model(llama):
    config = _resolved("--mock-data", "--load", str(llama), "--use-checkpoint-args", "-p", "2",
                       "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8")
    assert config.model == LLAMA
    # The layout is the run's; its chunks hold 8 / (2·2) layers, not the default 4's share.
    assert config.parallel.pipeline_model_parallel_size == 2
    assert config.parallel.num_layers_per_virtual_pipeline_stage == 2
    validate(config)
    check_model_fits(read_metadata(resolve(llama)), config.model, resolve(llama))
    # A flag that agrees is fine; a run setting given is the run's own.
    config = _resolved("--mock-data", "--load", str(llama), "--use-checkpoint-args",
                       "--num-layers", "8", "--num-query-groups", "2", "--seq-length", "8",
                       "--hidden-dropout", "0.1")
    assert config.model == dataclasses.replace(LLAMA, seq_length=8, hidden_dropout=0.1)
    # Without the flag nothing is taken.
    assert _resolved("--mock-data", "--load", str(llama)).model == ModelConfig()


def test_use_checkpoint_args_refuses_a_disagreeing_flag(llama):
    with pytest.raises(ConfigError) as caught:
        _resolved("--mock-data", "--load", str(llama), "--use-checkpoint-args",
                  "--hidden-size", "64", "--normalization", "LayerNorm", "--rotary-base", "10000",
                  "--layernorm-epsilon", "1e-5")
    problems = caught.value.problems
    assert len(problems) == 4
    assert "--hidden-size 64 disagrees with the checkpoint's 32" in problems[0]
    assert "--rotary-base 10000.0 disagrees with the checkpoint's 500000.0" in problems[1]
    assert "--normalization LayerNorm disagrees with the checkpoint's RMSNorm" in problems[2]
    assert "--layernorm-epsilon 1e-05 disagrees with the checkpoint's 1e-06" in problems[3]
    with pytest.raises(ConfigError, match="--use-checkpoint-args: --load .*nowhere: no such"):
        _resolved("--mock-data", "--load", str(llama / "nowhere"), "--use-checkpoint-args")


def test_use_checkpoint_args_trains_from_a_command_line_without_shape_flags(llama, tmp_path,
                                                                           capsys):
    """A real run: the checkpoint's model loaded and fine-tuned, said at start."""
    metrics = tmp_path / "metrics.jsonl"
    assert main(["train", "--mock-data", "--load", str(llama), "--use-checkpoint-args",
                 "--finetune", "--micro-batch-size", "1", "--global-batch-size", "2",
                 "--train-iters", "2", "--metrics-file", str(metrics), "--save",
                 str(tmp_path / "ft")]) == 0
    out = capsys.readouterr().out
    assert f"ptdp: fine-tuning from {resolve(llama)} (the weights of iteration 1; starting at " \
        "iteration 0" in out and "(--use-checkpoint-args)" in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    saved = read_metadata(resolve(tmp_path / "ft"))
    assert ModelConfig(**saved["config"]["model"]) == LLAMA


# --------------------------------------------------------------------------- MoE settings (issue 38)

MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                  hidden_dropout=0.0, attention_dropout=0.0, num_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=16, moe_router_load_balancing_type="seq_aux_loss",
                  moe_aux_loss_coeff=0.001, moe_z_loss_coeff=0.002,
                  moe_router_bias_update_rate=0.01, moe_expert_capacity_factor=2.0,
                  moe_token_drop_policy="position")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    save = tmp_path_factory.mktemp("moe") / "ckpt"
    trainer = Trainer(_config(model=MOE), _single(), CPU)
    trainer.step(0)
    trainer.save(str(save), 1)
    return save


MOE_SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--vocab-size", "64", "--num-experts", "4",
             "--moe-ffn-hidden-size", "16"]


def test_use_checkpoint_args_takes_how_the_experts_were_trained(moe):
    """An imported Qwen3-MoE's router_aux_loss_coef trained as 0: the
    balancing settings were not taken."""
    config = _resolved("--mock-data", "--load", str(moe), "--use-checkpoint-args")
    assert config.model == MOE
    given = _resolved("--mock-data", "--load", str(moe), "--use-checkpoint-args",
                      "--moe-aux-loss-coeff", "0.01", "--moe-token-drop-policy", "probs")
    assert given.model == dataclasses.replace(MOE, moe_aux_loss_coeff=0.01,
                                              moe_token_drop_policy="probs")


def test_a_resume_with_other_routing_says_what_changed(moe):
    same = _resolved("--mock-data", "--load", str(moe), "--use-checkpoint-args")
    assert changed_settings_note(same) == []
    # With --use-checkpoint-args another routing is refused (above); another
    # balancing loss is the run's own, and said.
    other = _resolved("--mock-data", "--load", str(moe), "--use-checkpoint-args",
                      "--moe-aux-loss-coeff", "0.01")
    [note] = changed_settings_note(other)
    assert note.startswith("ptdp: note: ") and "--moe-aux-loss-coeff 0.01 (checkpoint: 0.001)" in note
    assert "drop those flags to take the checkpoint's" in note
    # Without --use-checkpoint-args: every setting the run gives differently.
    bare = _resolved("--mock-data", "--load", str(moe), *MOE_SHAPE, "--moe-router-topk", "3",
                     "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias")
    [note] = changed_settings_note(bare)
    for change in ("--moe-router-topk 3 (checkpoint: 2)",
                   "--moe-router-score-function sigmoid (checkpoint: softmax)",
                   "--moe-router-enable-expert-bias on (checkpoint: off)",
                   "--moe-aux-loss-coeff 0.0 (checkpoint: 0.001)",
                   "--moe-expert-capacity-factor none (checkpoint: 2.0)",
                   "--moe-router-load-balancing-type aux_loss (checkpoint: seq_aux_loss)"):
        assert change in note, note
    assert "--use-checkpoint-args takes the checkpoint's" in note
    # Another model is refused elsewhere (check_model_fits), not noted.
    assert changed_settings_note(_resolved("--mock-data", "--load", str(moe))) == []


def test_ptdp_train_says_the_changed_routing_before_it_resumes(moe, capsys):
    assert main(["train", "--mock-data", "--load", str(moe), *MOE_SHAPE, "--moe-router-topk", "3",
                 "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff",
                 "0.001", "--moe-z-loss-coeff", "0.002", "--moe-router-bias-update-rate", "0.01",
                 "--moe-expert-capacity-factor", "2", "--moe-token-drop-policy", "position",
                 "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
                 "--use-checkpoint-opt_param-scheduler"]) == 0
    out = capsys.readouterr().out
    assert "ptdp: note: this run's model differs from the one --load" in out
    # the only change, said once
    assert out.count("--moe-router-topk 3 (checkpoint: 2) (drop those flags") == 1
