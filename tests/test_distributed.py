"""torchrun data parallelism on CPU with gloo: a 2-process run computes the same update as a 1-process run of
the same config (batch-level statistics gathered, token weights global, DDP gradients), and a run
checkpointed under 2 processes resumes under 2 or 1 and ends where the uninterrupted run ends."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cohortrl.trainers.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
VOLATILE = ("time/", "tokens_per_s", "peak_rss_mb")
RUN_TIMEOUT_S = 600  # a run hung in a collective fails its test after this


def torchrun(nproc: int, config: Path, run_dir: Path, *extra: str, module: str = "cohortrl") -> str:
    """Run ``cohortrl train`` (through ``module``'s ``__main__``) under torchrun; returns its log (stderr, at INFO level)."""
    return finish(start(nproc, config, run_dir, *extra, module=module), run_dir)


def one_and_two(config: Path, root: Path, *extra: str, module: str = "cohortrl", env: dict | None = None) -> tuple[str, str]:
    """The same run under one process (``root/one``) and under two (``root/two``), side by side (each worker has
    one thread, the machine 2 cores): their logs. ``env`` maps the process count to variables of its own."""
    procs = {n: start(n, config, root / name, *extra, module=module, env=(env or {}).get(n, {}))
             for n, name in ((1, "one"), (2, "two"))}
    return finish(procs[1], root / "one"), finish(procs[2], root / "two")


def start(nproc: int, config: Path, run_dir: Path, *extra: str, module: str = "cohortrl", env: dict | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, "-v", "train", str(config), "--run-dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, run_dir: Path) -> str:
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # A run hung in a collective (one rank failed, the other waiting): kill torchrun and its workers, which
        # torchrun starts in sessions of their own (they would hold the pipes open and hang communicate()).
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in workers_of(run_dir):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return stderr


def workers_of(run_dir: Path) -> list[int]:
    """The processes whose command line names ``run_dir`` (Linux's /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(run_dir).encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            pass  # gone meanwhile
    return pids


def weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    assert files, f"no weights in {checkpoint_dir}"
    out = {}
    for f in files:
        out.update({f"{f.stem}/{k}": v for k, v in load_file(f).items()})
    return out


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    wa, wb = weights(a), weights(b)
    assert sorted(wa) == sorted(wb)
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory, addition_jsonl) -> Path:
    """One config exercising every statistic that spans the batch: batch-std advantages, token-mean
    aggregation over the global token count, two minibatches of one group each (so each rank sits out one),
    two epochs (old log-probs), micro-batches of 2 (gradient accumulation under no_sync)."""
    config = {
        "model": {"name": "tiny-llama", "system_prompt": None},
        "data": {"source": f"jsonl:{addition_jsonl}", "eval_size": 4},
        "sampling": {"max_new_tokens": 8, "temperature": 1.0},
        "reward": {"functions": [{"name": "tests.trainers.reward_fns:starts_with_letter"}],
                   "correctness": "tests.trainers.reward_fns:starts_with_letter"},
        "algorithm": {"estimator": "grpo_batch", "aggregation": "token-mean", "group_size": 4, "prompts_per_step": 2,
                      "minibatches": 2, "epochs": 2, "micro_batch_size": 2, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 4, "checkpoint_every": 2, "progress": False},
        "eval": {"before": False, "n_prompts": 4, "batch_size": 4},
    }
    path = tmp_path_factory.mktemp("ddp_config") / "ddp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, config_path):
    """The config run under one process, two, and two with FSDP2."""
    root, path = tmp_path_factory.mktemp("ddp"), config_path
    one = start(1, path, root / "one")  # beside the two-process run: one thread each, 2 cores
    (root / "two.log").write_text(torchrun(2, path, root / "two", "--steps", "2"))
    finish(one, root / "one")
    (root / "fsdp.log").write_text(torchrun(2, path, root / "fsdp", "--steps", "2", "train.strategy=fsdp", module="tests.deepcopy_spy"))
    return root, path


def held_elements(log: str) -> dict[tuple[int, str], tuple[int, int]]:
    """{(rank, model): (parameter elements the rank holds, in total)} from the trainer's line per rank."""
    held = {}
    for rank, strategy, models in re.findall(r"cohortrl: rank (\d) of 2 \((\w+)\): (.*)$", log, re.MULTILINE):
        for part in models.split(", "):  # the whole line is read: a word too many or too few fails the test
            match = re.fullmatch(r"(\w+) (\d+) of (\d+) parameter elements", part)
            assert match, f"not '<model> <held> of <total> parameter elements': {part!r}"
            name, h, total = match.groups()
            held[int(rank), f"{strategy} {name}"] = int(h), int(total)
    return held


def assert_same_metrics(one: Path, other: Path, steps=(1, 2)) -> None:
    """Every logged number of the given steps agrees (loss, KL, grad norm, rewards, advantages' statistics)."""
    rows_one = {r["step"]: r for r in read_metrics(one) if "loss" in r}
    rows_other = {r["step"]: r for r in read_metrics(other) if "loss" in r}
    for step in steps:
        for key, value in rows_one[step].items():
            if key.startswith(VOLATILE) or value is None or isinstance(value, str):
                continue
            assert rows_other[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)


def test_two_processes_compute_the_same_update_as_one(runs):
    root, _ = runs
    # After two full steps (each: 2 epochs x 2 minibatches), weights and optimiser states on disk.
    one, two = root / "one" / "checkpoints", root / "two" / "checkpoints"
    assert_same_weights(one / "step_000002", two / "step_000002")
    assert_same_metrics(root / "one", root / "two")


def test_ddp_gives_each_rank_the_whole_model_and_fsdp2_a_share(runs):
    root, _ = runs
    ddp, fsdp = held_elements((root / "two.log").read_text()), held_elements((root / "fsdp.log").read_text())
    assert sorted(ddp) == [(r, f"ddp {m}") for r in (0, 1) for m in ("policy", "reference")]
    assert all(h == t for h, t in ddp.values())
    assert sorted(fsdp) == [(r, f"fsdp {m}") for r in (0, 1) for m in ("policy", "reference")]
    for model in ("policy", "reference"):  # dim-0 shards: each rank about half, together all of it
        (h0, t0), (h1, t1) = fsdp[0, f"fsdp {model}"], fsdp[1, f"fsdp {model}"]
        assert t0 == t1 == ddp[0, f"ddp {model}"][1] and h0 + h1 == t0
        assert max(h0, h1) < 0.6 * t0, (model, h0, h1, t0)
    # FSDP2's reference is made shard by shard from the sharded policy: no rank copies a model whole
    # (tests/deepcopy_spy.py reports every deep copy of a module in the FSDP2 run's log)
    copies = re.findall(r"^deepcopy: (\w+) (\d+) parameter elements$", (root / "fsdp.log").read_text(), re.MULTILINE)
    assert not [c for c in copies if int(c[1]) >= fsdp[0, "fsdp policy"][1] // 2], copies


def test_fsdp2_sharded_over_two_processes_computes_the_same_update(runs, tmp_path):
    root, path = runs
    assert_same_weights(root / "one" / "checkpoints" / "step_000002", root / "fsdp" / "checkpoints" / "step_000002")
    assert_same_metrics(root / "one", root / "fsdp")  # the grad norm too: under FSDP2 a DTensor over the shards
    resumed = tmp_path / "fsdp"
    import shutil

    shutil.copytree(root / "fsdp", resumed)
    log = torchrun(2, path, resumed, "--resume", "train.strategy=fsdp", module="tests.call_spy")
    assert_same_weights(root / "one" / "final", resumed / "final")
    # rank 0 alone reads the checkpoint and sends the weights and optimiser state into the shards
    assert re.findall(r"checkpoint read: rank (\d)", log) == ["0"]


@pytest.mark.parametrize("nproc", [2, 1])
def test_a_two_process_checkpoint_resumes_under_two_or_one(runs, nproc, tmp_path):
    root, path = runs
    resumed = tmp_path / "resumed"
    import shutil

    shutil.copytree(root / "two", resumed)
    torchrun(nproc, path, resumed, "--resume")
    assert_same_weights(root / "one" / "final", resumed / "final")
    steps = [r["step"] for r in read_metrics(resumed) if "loss" in r]
    assert steps == [1, 2, 3, 4]


def test_fsdp2_with_a_lora_adapter_matches_one_process(runs, tmp_path):
    _, path = runs
    lora = ("model.lora.enabled=true", "model.lora.r=4", "--steps", "1")
    one = start(1, path, tmp_path / "one", *lora)  # beside the two-process run
    torchrun(2, path, tmp_path / "fsdp", *lora, "train.strategy=fsdp")
    finish(one, tmp_path / "one")
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "fsdp" / "final")


def test_resampling_chooses_the_same_groups_under_two_processes(runs, tmp_path):
    _, path = runs
    # Rarer successes (a response starting with a vowel): many groups are all-wrong, so the step resamples.
    vowel = "tests.trainers.reward_fns:starts_with_vowel"
    resample = ("algorithm.zero_variance=resample", "algorithm.max_resample_draws=12", "algorithm.group_size=2", "--steps", "1",
                f"reward.functions=[{{name: '{vowel}'}}]", f"reward.correctness={vowel}")
    one_and_two(path, tmp_path, *resample)
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    one, two = (read_metrics(tmp_path / run)[0] for run in ("one", "two"))
    assert one["resample_draws"] == two["resample_draws"] >= 1
    assert one["reward_mean"] == pytest.approx(two["reward_mean"]) and one["trained_responses"] == two["trained_responses"]


def test_each_rank_generates_its_groups_in_one_call(config_path, tmp_path):
    """Under torchrun a rank generates its share of the step's groups in one batched call, as one process does
    (it made one call per group before): with 4 prompts over 2 processes each rank calls the engine once, with
    its 2 groups, and the update equals a 1-process run's, which samples all 4 in one call (each group under
    its own seed in either). ``tests/call_spy.py`` reports every call of the engine."""
    four = ("algorithm.prompts_per_step=4", "--steps", "1")
    logs = one_and_two(config_path, tmp_path, *four, module="tests.call_spy")
    calls = [sorted(re.findall(r"generate: rank (\d) rows (\d+)", log)) for log in logs]
    assert calls == [[("0", "4")], [("0", "2"), ("1", "2")]]
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")


def test_ppo_with_its_critic_matches_one_process(runs, tmp_path):
    _, path = runs
    ppo = ("algorithm.name=ppo", "algorithm.group_size=1", "algorithm.estimator=grpo", "--steps", "2")  # PPO keeps the default estimator (its advantages are GAE)
    one_and_two(path, tmp_path, *ppo)
    step = ("checkpoints", "step_000002")
    assert_same_weights(tmp_path / "one" / Path(*step), tmp_path / "two" / Path(*step))  # policy and critic
    one, two = (read_metrics(tmp_path / run) for run in ("one", "two"))
    for a, b in zip(one, two):
        for key in ("kl_coef", "value_loss", "explained_variance", "reward_mean"):
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_ranks_with_responses_of_different_lengths_match_one_process(config_path, tmp_path):
    """A stop string ends the tiny model's responses early and at random, so each rank pads its rollout to its own
    longest response: the gathered advantages (padded to the longest over ranks) must be cut back to each rank's
    width. Checked that the ranks' widths really differed at some step, from the lengths the reward saw."""
    path = config_path
    logging_fn = "tests.trainers.reward_fns:starts_with_letter_logging_lengths"
    uneven = ("sampling.stop=[e]", "sampling.max_new_tokens=24", f"reward.functions=[{{name: '{logging_fn}'}}]", f"reward.correctness={logging_fn}",
              "--steps", "2")
    one_and_two(path, tmp_path, *uneven, env={n: {"COHORTRL_TEST_LENGTHS": str(tmp_path / f"lengths_{n}.jsonl")} for n in (1, 2)})
    assert_same_weights(tmp_path / "one" / "final", tmp_path / "two" / "final")
    calls = [json.loads(line) for line in (tmp_path / "lengths_2.jsonl").read_text().splitlines()]
    widths = {(c["step"], c["rank"]): max(c["lengths"]) for c in calls}
    assert any(widths[(step, 0)] != widths[(step, 1)] for step in (0, 1)), widths


def test_a_step_runs_where_the_gpu_backend_serves_only_cuda_tensors(config_path, tmp_path):
    """As on a GPU machine, where NCCL serves CUDA tensors only: the trainer's own collectives on CPU tensors
    (gathered rows, summed metrics, the objects) must reach a backend that serves them. ``tests/nccl_standin.py``
    puts a stand-in for NCCL that refuses CPU tensors as NCCL does; two processes run a whole step (sampling,
    advantages over the gathered batch, DDP's update, metrics, a checkpoint) within the configured timeout."""
    log = torchrun(2, config_path, tmp_path / "run", "--steps", "1", "train.device=cpu", "train.dist_timeout_s=123",
                   module="tests.nccl_standin")
    assert sorted(re.findall(r"nccl stand-in: rank (\d) of 2, timeout (\S+) s", log)) == [("0", "123"), ("1", "123")], log[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1] and rows[0]["trained_responses"] == 8
    assert (tmp_path / "run" / "final").is_dir()


FSDP2_BF16 = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
from cohortrl.config import OptimConfig
from cohortrl.distributed import shard
from cohortrl.models import load_model
from cohortrl.trainers.setup import build_optimizer
model, _ = load_model("tiny-llama", dtype="bfloat16")
shard(model)
held = sorted({{str(p.dtype) for p in model.parameters()}})
logits = model(input_ids=torch.randint(0, 100, (2, 6))).logits
logits.float().logsumexp(-1).mean().backward()
grads = sorted({{str(p.grad.dtype) for p in model.parameters()}})
print(held, str(logits.dtype), grads, type(build_optimizer(model, OptimConfig())).__name__)
dist.destroy_process_group()
"""


def test_fsdp2_shards_a_bf16_model_in_float32_and_computes_in_bf16():
    """``model.dtype: bfloat16`` under FSDP2: each rank's shards (what AdamW steps) in float32, the forward and
    backward in bf16 (parameters all-gathered in bf16), gradients reduced and kept in float32; the optimiser is
    plain AdamW on the float32 shards. One process (gloo): what FSDP2 does with the policy does not depend on N."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", FSDP2_BF16.format(port=port)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "['torch.float32'] torch.bfloat16 ['torch.float32'] AdamW"
