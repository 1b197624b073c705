"""What the target and drafter trainers share: the token data, the learning-rate
schedule, mixed precision, the compiled step, checkpoints, and the budgeted loop.

Mixed precision: the optimizer owns float32 master weights; each step casts them to
the compute dtype (bfloat16 on a GPU) for the forward and backward, and the gradients
flow back through the cast to the float32 masters. With float32 compute the cast is a
no-op and this is plain training.

A run is budgeted in wall-clock minutes (`Budget`): the loop stops when the budget is
spent, and a checkpoint (master weights, optimizer state, step, data RNG, schedule) is
written every few minutes and at the end, so the next invocation `--resume`s where this
one stopped. The learning rate follows warmup and cosine decay over a number of steps:
`--steps`, or as many steps as fit in the budget (or in `--schedule-minutes` of
training), counted from the speed of the first steps and then kept in the checkpoint,
so a run cut into several invocations follows one schedule.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
CHECKPOINT_VERSION = 1


def log(message: str) -> None:
    print(message, file=sys.stdout, flush=True)


# --- data -------------------------------------------------------------------------------


def load_tokens(data: str | Path, part: str) -> np.ndarray:
    """The tokens of a part ("train" or "eval"): the corpus step's flat array, or the
    generate step's rows."""
    path = Path(data) / f"{part}.npy"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run the corpus (or generate) step first")
    return np.load(path)


def random_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` windows of `length` tokens at uniformly random starts: [batch, length]."""
    if tokens.size <= length:
        raise ValueError(f"{tokens.size} tokens cannot fill a window of {length}")
    starts = rng.integers(0, tokens.size - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, length: int, count: int) -> np.ndarray:
    """`count` windows spread evenly over the array (fixed, so every evaluation of every
    run reads the same text): [count, length]."""
    count = max(1, min(count, tokens.size // length))
    starts = np.linspace(0, tokens.size - length, count).astype(np.int64)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


# --- schedule and budget ----------------------------------------------------------------


@dataclass
class Schedule:
    """Linear warmup over `warmup` steps, then cosine decay from `peak` to
    `peak * floor` at `total_steps`; the peak until `total_steps` is known."""

    peak: float
    warmup: int
    floor: float
    total_steps: int | None = None

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.total_steps is None:
            return self.peak
        progress = min(max((step - self.warmup) / max(self.total_steps - self.warmup, 1), 0.0), 1.0)
        return self.peak * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class Budget:
    """The wall-clock budget of one invocation, from when it was made."""

    def __init__(self, minutes: float):
        self.started = time.monotonic()
        self.deadline = self.started + 60 * minutes

    def spent(self) -> bool:
        return time.monotonic() >= self.deadline

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def clock(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


# --- the optimizer step -----------------------------------------------------------------


@dataclass
class OptimizerSettings:
    lr: float
    warmup: int
    floor: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)


def make_optimizer(settings: OptimizerSettings) -> optim.Optimizer:
    """AdamW; norms and other vectors are not decayed (decay would pull their unit
    gains toward zero), matrices are."""
    betas = list(settings.betas)
    decayed = optim.AdamW(settings.lr, betas=betas, weight_decay=settings.weight_decay, bias_correction=True)
    plain = optim.AdamW(settings.lr, betas=betas, weight_decay=0.0, bias_correction=True)
    return optim.MultiOptimizer([decayed, plain], [lambda path, p: p.ndim >= 2])


def cast_tree(tree, dtype):
    return tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, tree)


LossFn = Callable[..., tuple[mx.array, tuple[mx.array, ...]]]


class Stepper:
    """One model's float32 master weights, its optimizer, and its (compiled) step.

    `loss_fn(model, *batch) -> (loss, metrics)` is evaluated with the model's weights set
    to the masters cast to `dtype`. Arrays it reads from elsewhere (a frozen target)
    enter the compiled step as constants."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, settings: OptimizerSettings, dtype: str, compile: bool = True):
        self.model = model
        self.dtype = DTYPES[dtype]
        self.master = {"params": cast_tree(model.trainable_parameters(), mx.float32)}
        self.optimizer = make_optimizer(settings)
        self.optimizer.init(self.master["params"])
        mx.eval(self.master, self.optimizer.state)

        def loss_of(params, *batch):
            model.update(cast_tree(params, self.dtype))
            return loss_fn(model, *batch)

        grad_fn = mx.value_and_grad(loss_of)

        def step(*batch):
            (loss, metrics), grads = grad_fn(self.master["params"], *batch)
            grads, norm = optim.clip_grad_norm(grads, settings.grad_clip)
            self.master["params"] = self.optimizer.apply_gradients(grads, self.master["params"])
            return loss, metrics, norm

        if compile:
            state = [self.master, self.optimizer.state]
            step = mx.compile(step, inputs=state, outputs=state)
        self._step = step

    def step(self, lr: float, *batch: mx.array) -> tuple[float, list[float], float]:
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        loss, metrics, norm = self._step(*batch)
        mx.eval(loss, metrics, norm, self.master, self.optimizer.state)
        return loss.item(), [m.item() for m in metrics], norm.item()

    def use_weights(self, dtype=None) -> nn.Module:
        """Set the model's weights from the masters (cast to `dtype`, by default the
        compute dtype), for evaluation or export; the step overwrites them as it runs."""
        self.model.update(cast_tree(self.master["params"], self.dtype if dtype is None else dtype))
        return self.model

    # --- checkpoints ---

    def save(self, path: Path, state: dict) -> None:
        """Masters, optimizer state and `state` (JSON) into `path`, replacing it whole:
        a kill mid-save leaves the previous checkpoint intact."""
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        mx.save_safetensors(str(tmp / "params.safetensors"), dict(tree_flatten(self.master["params"])))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        (tmp / "state.json").write_text(json.dumps({"version": CHECKPOINT_VERSION, **state}, indent=2) + "\n")
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path) -> dict:
        """Restore masters and optimizer state in place (so the compiled step keeps
        reading them); returns the saved `state`."""
        params = tree_unflatten(list(mx.load(str(path / "params.safetensors")).items()))
        opt_state = tree_unflatten(list(mx.load(str(path / "optimizer.safetensors")).items()))
        _replace_leaves(self.master["params"], params)
        _replace_leaves(self.optimizer.state, opt_state)
        mx.eval(self.master, self.optimizer.state)
        return read_state(path)


def _replace_leaves(tree, source) -> None:
    """Copy `source`'s arrays into the same places of `tree`, keeping `tree`'s containers
    (the compiled step holds references to them). Shapes must match."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, (dict, list)):
            _replace_leaves(value, source[key])
        else:
            new = source[key]
            if new.shape != value.shape:
                raise ValueError(f"checkpoint array {key} has shape {new.shape}, the model expects {value.shape}")
            tree[key] = new


def read_state(path: Path) -> dict:
    state = json.loads((path / "state.json").read_text())
    if state.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path} is a version {state.get('version')} checkpoint; this trainer reads version {CHECKPOINT_VERSION}")
    return state


# --- the budgeted loop ------------------------------------------------------------------


@dataclass
class RunSettings:
    minutes: float  # this invocation's wall-clock budget
    steps: int | None  # the schedule's length; default: what fits in the budget
    schedule_minutes: float | None  # or: what fits in this many minutes of training, over all invocations
    log_every: int = 50
    checkpoint_minutes: float = 2.0
    eval_every: int = 0  # steps; 0: only at the end


@dataclass
class Progress:
    """What a checkpoint records of where a run stands."""

    step: int = 0
    trained_seconds: float = 0.0  # time in steps, without each invocation's first (compiling) step
    tokens: int = 0


# Steps timed before the schedule's length is set from their speed.
CALIBRATION_STEPS = 10
# Seconds kept at the end of a budget for the last checkpoint, evaluation and export.
END_RESERVE = 20.0


class Run:
    """The budgeted loop around a Stepper.

    `next_batch(rng) -> (arrays, tokens)` draws a training batch, `evaluate() -> dict`
    measures held-out quality (the model's weights already set from the masters),
    `export(evaluation)` writes the usable artifact. The checkpoint directory holds
    everything needed to continue."""

    def __init__(self, stepper: Stepper, checkpoint: Path, config: dict, settings: RunSettings, opt: OptimizerSettings, seed: int, metric_names: tuple[str, ...] = ()):
        self.stepper = stepper
        self.checkpoint = Path(checkpoint)
        self.config = config
        self.settings = settings
        self.metric_names = metric_names
        self.progress = Progress()
        self.rng = np.random.default_rng(seed)
        self.schedule = Schedule(opt.lr, opt.warmup, opt.floor, settings.steps)

    def resume(self) -> None:
        """Continue from the checkpoint: weights, optimizer, step, data order, and the
        schedule's length unless `--steps` or `--schedule-minutes` set a new one."""
        state = self.stepper.load(self.checkpoint)
        self.progress = Progress(**state["progress"])
        self.rng.bit_generator.state = state["rng"]
        if self.settings.steps is None and self.settings.schedule_minutes is None:
            self.schedule.total_steps = state["schedule"]["total_steps"]
        log(f"resumed {self.checkpoint} at step {self.progress.step} ({clock(self.progress.trained_seconds)} trained)")

    def save(self) -> None:
        started = time.perf_counter()
        self.stepper.save(self.checkpoint, {
            "config": self.config,
            "progress": asdict(self.progress),
            "rng": self.rng.bit_generator.state,
            "schedule": asdict(self.schedule),
        })
        log(f"checkpoint step {self.progress.step} -> {self.checkpoint} ({time.perf_counter() - started:.1f} s)")

    def finished(self) -> bool:
        return self.schedule.total_steps is not None and self.progress.step >= self.schedule.total_steps

    def calibrate(self, budget: Budget, seconds_per_step: float) -> None:
        """Set the schedule's length from the measured speed: the steps that fit in
        `--schedule-minutes` of training, or else in what is left of this budget."""
        if self.settings.schedule_minutes is not None:
            self.schedule.total_steps = max(int(60 * self.settings.schedule_minutes / seconds_per_step), self.progress.step)
        else:
            self.schedule.total_steps = self.progress.step + int(max(budget.remaining() - END_RESERVE, 0) / seconds_per_step)
        log(f"schedule: {self.schedule.total_steps} steps at {seconds_per_step:.3f} s per step")

    def train(self, next_batch: Callable, evaluate: Callable[[], dict], export: Callable[[dict], None]) -> dict:
        """Step until the schedule ends or the budget is spent, then checkpoint,
        evaluate and export. Returns the last evaluation."""
        budget = Budget(self.settings.minutes)
        last_save = time.monotonic()
        window_start, window_tokens = time.perf_counter(), 0
        timed_seconds, timed_steps = 0.0, -1  # this invocation's first step compiles: not timed
        while not budget.spent() and not self.finished():
            arrays, tokens = next_batch(self.rng)
            lr = self.schedule(self.progress.step)
            started = time.perf_counter()
            loss, metrics, norm = self.stepper.step(lr, *arrays)
            seconds = time.perf_counter() - started
            self.progress.step += 1
            self.progress.tokens += tokens
            window_tokens += tokens
            timed_steps += 1
            if timed_steps > 0:
                timed_seconds += seconds
                self.progress.trained_seconds += seconds
            if timed_steps == CALIBRATION_STEPS and self.schedule.total_steps is None:
                self.calibrate(budget, timed_seconds / timed_steps)
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {self.progress.step}; lower --lr or use float32")
            if self.progress.step % self.settings.log_every == 0 or timed_steps == 0:
                elapsed = time.perf_counter() - window_start
                shown = "".join(f" | {n} {v:.3f}" for n, v in zip(self.metric_names, metrics))
                log(
                    f"step {self.progress.step:6d} | loss {loss:.4f}{shown} | lr {lr:.2e} | grad {norm:.2f} "
                    f"| {window_tokens / elapsed:,.0f} tok/s | {clock(budget.elapsed())}"
                )
                window_start, window_tokens = time.perf_counter(), 0
            if self.settings.eval_every and self.progress.step % self.settings.eval_every == 0:
                self._evaluate(evaluate)
            if time.monotonic() - last_save >= 60 * self.settings.checkpoint_minutes:
                self.save()
                last_save = time.monotonic()
        self.save()
        result = self._evaluate(evaluate)
        export(result)
        return result

    def _evaluate(self, evaluate: Callable[[], dict]) -> dict:
        started = time.perf_counter()
        self.stepper.use_weights()
        result = evaluate()
        shown = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items())
        log(f"eval step {self.progress.step} | {shown} | {time.perf_counter() - started:.1f} s")
        return result
