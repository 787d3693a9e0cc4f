"""Crash safety: a process saving checkpoints in a loop is killed with SIGKILL at random moments; after
every kill `latest` names a complete checkpoint that loads — with the engine, in the next process,
and offline — and matches what was saved.

Starting Python with torch takes seconds here, so one "zygote" process imports everything once and
forks a fresh saver for each round; the test kills the saver, the zygote reaps it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zerospeed.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zerospeed.checkpoint.consolidate import resolve_checkpoint
from zerospeed.checkpoint.naming import MODEL_STATES

ROUNDS = 6

ZYGOTE = r"""
import json, os, sys
import torch
import zerospeed
from zoo.models import TinyMLP

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 1, "reduce_bucket_size": 100000}}


def say(msg):
    # one write(2) per line: a kill between print's text and its newline would glue the zygote's next
    # line onto this one (lines under PIPE_BUF reach the pipe whole or not at all)
    os.write(1, (json.dumps(msg) + "\n").encode())


def saver(ckpt):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyMLP(d_in=16, d_hidden=384, d_out=8, n_layers=3)  # ~0.3M parameters: saves take a while
    engine, *_ = zerospeed.initialize(model=model, config=CONFIG)
    _, client = engine.load_checkpoint(ckpt)
    i = client["i"] + 1 if client else 0
    total = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
    say({"loaded": client["i"] if client else None, "steps": engine.global_steps, "sum": total})
    gen = torch.Generator().manual_seed(i)
    while True:
        engine.backward(engine(torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)))
        engine.step()
        total = sum(float(p.detach().double().sum()) for p in engine.module.parameters())
        # reuse three tags, so re-saving an existing tag (the directory swap) is killed too
        engine.save_checkpoint(ckpt, tag=f"t{i % 3}", client_state={"i": i, "sum": total})
        say({"saved": i})
        i += 1


print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "fork":
        pid = os.fork()
        if pid == 0:
            try:
                saver(arg)
            finally:
                os._exit(1)
        print(json.dumps({"pid": pid}), flush=True)
    elif cmd == "reap":
        _, status = os.waitpid(int(arg), 0)
        print(json.dumps({"status": status}), flush=True)
"""


def _line(proc) -> dict | str:
    raw = proc.stdout.readline()
    if not raw:
        raise AssertionError(f"zygote ended: {proc.stderr.read()[-3000:]}")
    raw = raw.strip()
    return json.loads(raw) if raw.startswith("{") else raw


def _next_json(proc, key: str) -> dict:
    while True:
        msg = _line(proc)
        if isinstance(msg, dict) and key in msg:
            return msg


def _check_latest(ckpt: Path) -> dict:
    """What a complete checkpoint must satisfy offline: every file matches the manifest (checked inside),
    the consolidated fp32 weights equal the module saved next to them, the client state agrees."""
    tag_dir, manifest = resolve_checkpoint(ckpt)
    fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    saved = torch.load(tag_dir / MODEL_STATES, weights_only=False)
    for k, v in saved["module"].items():
        assert torch.equal(fp32[k], v), f"{tag_dir}: {k}"
    assert saved["global_steps"] == saved["i"] + 1 == manifest["global_steps"]
    assert abs(sum(float(v.double().sum()) for v in fp32.values()) - saved["sum"]) < 1e-9
    return {"i": saved["i"], "tag": tag_dir.name}


@pytest.mark.timeout(150)
def test_sigkill_during_saves_always_leaves_a_loadable_latest(tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "ZEROSPEED_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert _line(zygote) == "ready"
        expected, interrupted = None, 0
        for round_ in range(ROUNDS):
            zygote.stdin.write(f"fork {ckpt}\n")
            zygote.stdin.flush()
            pid = _next_json(zygote, "pid")["pid"]
            report = _next_json(zygote, "loaded")
            where = f"round {round_} (seed {seed})"
            # the saver resumed from exactly the checkpoint `latest` named after the previous kill
            assert report["loaded"] == (expected["i"] if expected else None), where
            if expected is not None:
                assert report["steps"] == expected["i"] + 1, where
            first = _next_json(zygote, "saved")["saved"]  # at least one save of this round completed
            time.sleep(rng.uniform(0.0, 0.4))  # then die at a random moment, mostly inside a save
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"reap {pid}\n")
            zygote.stdin.flush()
            status = _next_json(zygote, "status")["status"]
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, where
            # a staging directory or temporary file left behind: this kill interrupted a save
            interrupted += any(p.name.endswith(".partial") or ".tmp-" in p.name for p in ckpt.rglob(".*"))
            expected = _check_latest(ckpt)
            assert expected["i"] >= first, where
        # A save is ~85% of the saver's loop, so six kills all missing one has probability ~1e-5.
        assert interrupted >= 1, f"no kill landed inside a save (seed {seed})"
    finally:
        zygote.kill()
        zygote.wait()
