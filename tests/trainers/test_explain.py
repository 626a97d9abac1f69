"""``cohortrl explain`` on traced steps of the tiny model (``tests/trainers/test_trace.py``'s runs): the terminal
walk-through fits 100 columns and tells the step in order with its loss reconciled to the logged one; the HTML
page, opened in headless Chromium (Debian's ``chromium`` package), loads without errors and shows the prompt,
the responses and the group table; the command line records steps with ``--trace-steps`` and explains them."""

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from cohortrl.cli import main
from cohortrl.trainers.explain import WIDTH, explain_html, explain_text, logged_row
from cohortrl.trainers.trace import load_trace
from tests.trainers.test_trace import one_thread_no_plots, traced_runs  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install -y chromium)")


@pytest.mark.parametrize("name", ["grpo", "grpo_process", "kl_in_reward", "grpo_epochs2", "ppo", "rft", "tools"])
def test_the_terminal_walk_through_fits_100_columns_and_reconciles_the_logged_loss(traced_runs, name):
    run_dir, rows = traced_runs(name)
    step = rows[-1]["step"]
    trace, logged = load_trace(run_dir, step), logged_row(run_dir, step)
    assert logged["loss"] == rows[-1]["loss"]
    for k in range(len(trace["prompts"])):
        text = explain_text(trace, logged, prompt=k, run_dir=str(run_dir))
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)
        # the step's order: sampled → rewards → advantages → objective → loss
        heads = [next(i for i, line in enumerate(lines) if line.startswith(f"{n}. ")) for n in range(1, 6)]
        assert heads == sorted(heads)
        assert trace["prompts"][k].splitlines()[0] in text
        logged_line = next(line for line in lines if line.lstrip().startswith("logged loss"))
        assert f"{logged['loss']:.6g}" in logged_line
        # every response of the group has its token table, a line per token
        G = trace["settings"]["group_size"]
        for i in range(k * G, k * G + G):
            assert f"response {i - k * G}: sum_t w_t L_t" in text
        assert sum(1 for line in lines if re.match(r"^\s{4,}\d+ ", line)) >= sum(
            len(trace["tokens"][i]) for i in range(k * G, k * G + G))
    if name == "ppo":
        assert "GAE" in text and "V_t" in text
    if name == "rft":
        assert "supervised term" in text and "KL term" not in text
    if name == "tools":  # the tool's result is marked t, outside the loss
        assert re.search(r"^\s+\d+ .{10} t ", text, re.M)


def test_a_long_prompt_is_wrapped_between_words(traced_runs):
    """A prompt wider than the terminal breaks at spaces (it was cut at column 98, mid-word: "writ" / "e ANSWER")."""
    run_dir, rows = traced_runs("grpo")
    trace = load_trace(run_dir, rows[-1]["step"])
    trace["prompts"][0] = " ".join(f"word{k}" for k in range(60))  # 430 characters; column 98 falls inside a word
    lines = explain_text(trace, None, prompt=0).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("prompt 0 of")) + 1
    shown = lines[start: lines.index("", start)]
    assert len(shown) > 1 and max(len(line) for line in shown) <= WIDTH
    assert " ".join(line.strip() for line in shown) == trace["prompts"][0]


def test_the_aggregation_weight_is_shown_to_six_decimals(traced_runs):
    """w_t = 1/(N·|o_i|) is ~1e-3 on a real step: four decimals showed 0.0009 for 144 tokens and 0.0008 for 148."""
    from cohortrl.trainers.explain import token_view

    run_dir, rows = traced_runs("grpo")
    trace = load_trace(run_dir, rows[-1]["step"])
    lines = explain_text(trace, None, prompt=0).splitlines()
    first = lines[next(i for i, line in enumerate(lines) if line.startswith("   response 0: sum_t")) + 2]
    assert first.split()[-2] == f"{float(token_view(trace)['weight'][0, 0]):.6f}", first


@pytest.mark.parametrize("estimator, by_hand", [
    ("grpo", "-0.7833"),  # (0 − 0.375) / (0.4787136 + 1e-6)
    ("dr_grpo", "-0.3750"),  # 0 − 0.375
    ("rloo", "-0.5000"),  # 0 − (1 + 0.5 + 0) / 3
    # the batch's 8 rewards 1, 0, 0.5, 0, 1, 1, 1, 1: mean 5.5 / 8 = 0.6875, squared deviations 0.09765625,
    # 0.47265625, 0.03515625, 0.47265625, 4 x 0.09765625: sum 1.46875, / 7 = 0.2098214, std 0.4580627;
    # −0.375 / (0.4580627 + 1e-6) = −0.8187
    ("grpo_batch", "-0.8187"),
])
def test_a_hand_built_groups_arithmetic_is_shown(tmp_path, estimator, by_hand):
    from tests.trainers.test_trace import config, positional, train

    cfg = config("grpo", trace_steps=[1], steps=1)
    cfg["algorithm"]["estimator"] = estimator
    train(tmp_path, cfg, reward_funcs=[positional], reward_weights=[1.0])
    trace = load_trace(tmp_path, 1)
    text = explain_text(trace, logged_row(tmp_path, 1), prompt=0)
    assert "mean_g = (1.000 + 0.000 + 0.500 + 0.000) / 4 = 0.3750" in text
    assert "= 0.4787" in text  # the sample std
    assert "identical rewards (on the correctness signal): no" in text
    # response 1 (reward 0): its advantage by hand, then as the step trained on it: the same
    assert re.search(rf"^\s+1\s+0\.0000\s+-0\.3750\s+{by_hand}\s+{by_hand}$", text, re.M), text
    other = explain_text(trace, logged_row(tmp_path, 1), prompt=1)  # four 1s; beta = 0.1, the policy unmoved
    assert re.search(r"identical rewards \(on the correctness signal\): yes; A = 0, so its policy term is 0, but its "
                     r"KL term \(beta = 0\.1, mean KL_t \S+ here\) still pulls", " ".join(other.split())), other


@pytest.mark.parametrize("settings, says", [
    ({"beta": 0.1}, "yes; A = 0, so its policy term is 0, but its KL term (beta = 0.1, mean KL_t"),
    ({"beta": 0.0}, "yes; A = 0 and no other term in the loss: this group carries no learning signal"),
    ({"beta": 0.1, "zero_variance": "filter"},
     "yes; dropped from the loss (zero_variance=filter): no gradient from this group"),
])
def test_an_identical_groups_line_says_what_is_left_of_its_gradient(tmp_path, settings, says):
    """An all-1 group at step 2, after step 1 moved the policy: with beta > 0 its KL term still acts (the line
    said "no learning signal" there too), and the traced loss shares agree with what the line says."""
    from cohortrl.trainers.trace import reconcile
    from tests.trainers.test_trace import config, positional, train

    cfg = config("grpo", trace_steps=[2], steps=2)
    cfg["algorithm"].update(settings)
    train(tmp_path, cfg, reward_funcs=[positional], reward_weights=[1.0])
    trace = load_trace(tmp_path, 2)
    text = explain_text(trace, logged_row(tmp_path, 2), prompt=1)
    assert f"identical rewards (on the correctness signal): {says}" in " ".join(text.split()), text
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    group = torch.zeros(len(trace["rewards"]), dtype=torch.bool)
    group[4:] = True  # prompt 1's four responses
    share = reconcile(trace, group)
    assert share["policy"] == 0.0
    if settings["beta"] > 0 and "zero_variance" not in settings:
        assert share["extra"] > 0  # the KL term's pull, the group's whole share of the loss
    else:
        assert share["loss"] == 0.0
    assert explain_text(trace, None, prompt=0).count("identical rewards (on the correctness signal): no") == 1


def test_the_command_line_records_and_explains_a_step(tmp_path):
    """``cohortrl train --trace-steps`` in this process (a tiny run), then ``cohortrl explain`` in a subprocess."""
    run_dir, page = tmp_path / "run", tmp_path / "step.html"
    assert main(["train", str(REPO / "configs" / "tiny_grpo.yaml"), "--run-dir", str(run_dir), "--trace-steps", "2",
                 "train.steps=2", "train.progress=false", "train.checkpoint_every=0", "eval.n_prompts=0",
                 "data.eval_size=0"]) == 0
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == ["step_2.pt"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "cohortrl", "explain", str(run_dir), "--step", "2", "--prompt", "1",
                          "--html", str(page)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert max(len(line) for line in out.stdout.splitlines()) <= WIDTH
    assert "prompt 1 of 2" in out.stdout and f"wrote {page}" in out.stdout
    assert page.read_text().startswith("<!doctype html>")
    missing = subprocess.run([sys.executable, "-m", "cohortrl", "explain", str(run_dir), "--step", "1"],
                             capture_output=True, text=True, env=env, timeout=600)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: no trace of step 1 in {run_dir} (traced steps there: 2); train with --trace-steps 1 "
        "(train.trace_steps: [1]) to record it"]


class _Text(HTMLParser):
    """The page's visible text and its tables' header cells."""

    def __init__(self):
        super().__init__()
        self.text, self.headers, self._th = [], [], False

    def handle_starttag(self, tag, attrs):
        self._th = tag == "th"

    def handle_endtag(self, tag):
        self._th = False

    def handle_data(self, data):
        self.text.append(data)
        if self._th:
            self.headers.append(data.strip())


@needs_chromium
@pytest.mark.parametrize("name", ["grpo", "tools"])
def test_the_html_page_loads_in_headless_chromium_and_shows_the_step(tmp_path, traced_runs, name):
    run_dir, rows = traced_runs(name)
    step = rows[-1]["step"]
    trace = load_trace(run_dir, step)
    page = tmp_path / "step.html"
    page.write_text(explain_html(trace, logged_row(run_dir, step), str(run_dir)))
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
              f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "step.png"
    out = subprocess.run([*common, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # loaded without errors: no console error and no failed load in Chromium's log
    assert not re.search(r"CONSOLE\(|net::ERR_|Uncaught", dom.stderr + out.stderr)
    parsed = _Text()
    parsed.feed(dom.stdout)
    text = "".join(parsed.text)
    for prompt in trace["prompts"]:
        assert prompt in text
    # every response's tokens, in order (compared on letters and digits: a random model writes control
    # characters, which HTML turns into other whitespace)
    letters = re.sub(r"[^0-9A-Za-z]", "", text)
    for i, tokens in enumerate(trace["tokens"]):
        assert re.sub(r"[^0-9A-Za-z]", "", "".join(tokens)) in letters, i
    for header in ("r", "r − mean", "A (first token)", "Σ w·L", "loss share (1/U Σ w·L)"):
        assert header in parsed.headers, header
    assert f"{rows[-1]['loss']:.6g}" in text  # the logged loss, in the decomposition
    assert dom.stdout.count("class='response'") + dom.stdout.count('class="response"') == len(trace["tokens"])
    if name == "tools":  # the tool's result is marked; at its step 1 the policy is the reference: no high KL
        assert 'class="tok tool"' in dom.stdout
        assert len(re.findall(r'class="[^"]*highkl', dom.stdout)) == 1  # the legend's


def test_ppos_advantages_show_the_whitening_and_no_value_where_gae_skips_the_token(traced_runs):
    """On a real PPO trace a right answer's early tokens had A_t(train) < 0 with every A_t(GAE) > 0: the
    whitening line shows the batch mean and std that did it, and they reproduce the trained advantages. A token
    outside the response mask (a tool's result) shows no V_t: GAE skips it, so its value was never used."""
    from cohortrl.trainers.explain import whitening

    run_dir, rows = traced_runs("ppo")
    trace = load_trace(run_dir, rows[-1]["step"])
    w = whitening(trace)
    m = trace["loss_mask"].bool()
    by_hand = (trace["detail"]["gae_advantages"].double() - w["mean"]) / (w["std"] + 1e-6)
    assert torch.allclose(by_hand[m], trace["advantages"][m].double(), atol=1e-5)
    assert w["tokens"] == int(m.sum()) > 1
    text = explain_text(trace, logged_row(run_dir, rows[-1]["step"]), prompt=0)
    assert f"A_t(train) = (A_t(GAE) - {w['mean']:.4f}) / ({w['std']:.4f} + eps)" in text
    assert "KL_t = logp_old - logp_ref" in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH

    def v_cells(tr):  # response 0's V_t column, a cell per token
        lines = explain_text(tr, None, prompt=0).split("A_t(train)        R_t\n", 1)[1].splitlines()
        return [line.split()[-4] for line in lines[: len(tr["tokens"][0])]]

    assert "-" not in v_cells(trace)
    skipped = {**trace, "response_mask": trace["response_mask"].clone(), "loss_mask": trace["loss_mask"].clone()}
    skipped["response_mask"][0, 1] = skipped["loss_mask"][0, 1] = 0  # token 1 of response 0 as a tool's result
    assert v_cells(skipped)[1] == "-" and v_cells(skipped)[0] != "-"
