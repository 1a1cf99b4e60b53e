"""`optax.chain(optax.clip_by_global_norm(c), tx)` in a `LayerStore`, in both update modes.

The model, batches and reference are `test_layer_update`'s: the same chain applied
by optax to the stacked layers in memory. The store sums the norm per leaf per
layer in float32 as the gradients pass the host, where optax sums each stacked
leaf on the device: the summation order differs, so the norm (and the params
after a step the clip applies to) match optax's to a tolerance, float32's
rounding of the sum (relative 1e-6 on the norm; see `test_clip_matches_optax`).
Given the store's norm, the rest is optax's own expression: the params equal, to
the bit, optax's clip formula applied with that norm followed by the rest of the
chain (`clipped_reference`). A step the clip leaves alone is the unclipped
chain's to the bit, and the backward mode's speculate-then-validate gives the
explicit mode's params and state to the bit, clip or not.
"""

import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import interrupted
from layer_store_run import clipped
from test_layer_update import (
  L,
  assert_bits,
  batch,
  grad,
  make_layers,
  make_layers_like,
  per_layer,
  rest_of,
)

import offlax
from offlax._src import errors
from offlax._src.layer_store import clip as clip_lib
from offlax._src.layer_store import micro
from offlax._src.layer_store import slots as slots_lib

HERE = os.path.dirname(os.path.abspath(__file__))

BIG, SMALL = 1e6, 1e-3  # a clip that never applies here, one that always does (asserted)


def chain(c, tail=lambda: optax.adam(1e-2)):
  return optax.chain(optax.clip_by_global_norm(c), tail())


def train(path, tx, dtype=jnp.float32, update="explicit", steps=3):
  """`steps` steps of the store; its params, state, each step's `last_update`, bytes moved
  and the bytes of its gradient slots."""
  store = offlax.LayerStore.create(path, make_layers(dtype), optimizer=tx, update=update,
                                   progress=False)  # fmt: skip
  stats, moved = [], []
  with store:
    for step in range(steps):
      before = store.bytes_read + store.bytes_written
      grad(store.source(), batch(step, dtype))
      store.update()
      stats.append(store.last_update)
      moved.append(store.bytes_read + store.bytes_written - before)
    grads = store.n_layers * sum(r["slot"] for r in store.records)
    return store.read_params(), store.read_state(), stats, moved, grads


def optax_run(tx, steps, dtype=jnp.float32, norms=None, c=None):
  """`tx` on the stacked layers in memory (two programs, as `test_layer_update.reference`),
  and optax's norm of each step's gradients. With `norms`, `tx` is the chain's tail and each
  step's gradients are first clipped to `c` by optax's expression with the given norm."""

  def clip(g, n):
    return jax.tree.map(lambda t: jax.lax.select(n < c, t, (t / n.astype(t.dtype)) * c), g)

  update = jax.jit(
    lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p))
  )
  params = make_layers(dtype)
  state, seen = tx.init(params), []
  for step in range(steps):
    g = grad(params, batch(step, dtype))
    seen.append(float(jax.jit(optax.tree.norm)(g)))
    if norms is not None:
      g = jax.jit(clip)(g, jnp.float32(norms[step]))
    params, state = update(g, state, params)
  return params, state, seen


CASES = [
  pytest.param(SMALL, id="clip-applies"),
  pytest.param(BIG, id="clip-idle", marks=pytest.mark.slow),  # (the test below: to the bit)
]


@pytest.mark.parametrize("c", CASES)
def test_clip_matches_optax(tmp_path, c):
  params, state, stats, *_ = train(str(tmp_path / "s"), chain(c))
  want_params, want_state, norms = optax_run(chain(c), 3)
  assert all(n > SMALL * 10 and n < BIG / 10 for n in norms)  # the clip applies, or not
  assert [s.clipped for s in stats] == [c == SMALL] * 3
  # The norm: float32 sums in another order than optax's: a few float32 roundings apart.
  np.testing.assert_allclose([s.grad_norm for s in stats], norms, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
  assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(want_state))  # (the clip's: none)
  # Given the store's norms, optax's expression and the tail: the same to the bit.
  tail_params, tail_state, _ = optax_run(
    optax.adam(1e-2), 3, norms=[s.grad_norm for s in stats], c=c
  )
  assert_bits(params, tail_params)
  assert_bits(state, per_layer(tail_state))  # the state kept is the tail's, tree for tree


def test_an_idle_clip_is_the_unclipped_chain_to_the_bit(tmp_path):
  clipped = train(str(tmp_path / "c"), chain(BIG))
  plain = train(str(tmp_path / "p"), optax.adam(1e-2))
  assert_bits(clipped[0], plain[0])
  assert_bits(jax.tree.leaves(clipped[1]), jax.tree.leaves(plain[1]))
  assert [s.clipped for s in clipped[2]] == [False] * 3
  assert [s.grad_norm for s in plain[2]] == [None] * 3


@pytest.mark.parametrize("c", CASES)
def test_backward_mode_speculates_then_validates(tmp_path, c):
  explicit = train(str(tmp_path / "e"), chain(c))
  backward = train(str(tmp_path / "b"), chain(c), update="backward")
  assert_bits(backward[0], explicit[0])
  assert_bits(backward[1], explicit[1])
  assert [s.clipped for s in backward[2]] == [c == SMALL] * 3
  assert [s.grad_norm for s in backward[2]] == [s.grad_norm for s in explicit[2]]
  # What the clip costs: its gradients written (4 bytes a param, fp32), and where it
  # applies the explicit update's reads and writes again.
  plain = train(str(tmp_path / "p"), optax.adam(1e-2), update="backward")
  grads = backward[4]
  extra = [a - b for a, b in zip(backward[3], plain[3], strict=True)]
  if c == BIG:
    assert extra == [grads] * 3
  else:
    assert all(e > 3 * grads for e in extra)


@pytest.mark.slow
def test_the_clip_comes_and_goes_on_a_store(tmp_path):
  """The clip has no state: a store made without it opens with it, and back; a longer tail
  (``chain(clip, a, b)``) keeps ``chain(a, b)``'s state, as optax.adam's own chain."""
  path = str(tmp_path / "s")
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers(jnp.float32))
  for step, tx in enumerate([optax.adam(1e-2), chain(SMALL), optax.adam(1e-2)]):
    open_or_create = offlax.LayerStore.open if step else offlax.LayerStore.create
    with open_or_create(path, like if step else make_layers(jnp.float32), optimizer=tx,
                        progress=False) as store:  # fmt: skip
      grad(store.source(), batch(step, jnp.float32))
      store.update()
      assert store.last_update.clipped == (step == 1)
  tail = lambda: optax.chain(optax.scale_by_adam(), optax.scale(-1e-2))
  longer = train(str(tmp_path / "l"), chain(BIG, tail))
  plain = train(str(tmp_path / "p"), tail())
  assert_bits(longer[0], plain[0])
  assert_bits(longer[1], plain[1])


# Adam is nearly invariant to the gradients' scale: a wrong clip scale would pass its case.
# SGD's step is the scale times the gradient, and its lr makes the step large against the
# tolerances (asserted): a wrong scale fails.
TAILS = [pytest.param(lambda: optax.adam(1e-2), id="adam"),
         pytest.param(lambda: optax.sgd(10.0), id="sgd")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("update", ["explicit", "backward"])
def test_accumulated_gradients_clip_on_their_sum(tmp_path, update, tail):
  tx = chain(SMALL, tail)
  store = offlax.LayerStore.create(str(tmp_path / "s"), make_layers(jnp.float32), optimizer=tx,
                                   update=update, progress=False)  # fmt: skip
  with store:
    store.zero_grads()
    grad(store.source(accumulate=True), batch(0, jnp.float32))
    grad(store.source(accumulate=True, last=True), batch(1, jnp.float32))
    store.update()
    params, norm = store.read_params(), store.last_update.grad_norm
  layers = make_layers(jnp.float32)
  g = jax.tree.map(
    jnp.add, grad(layers, batch(0, jnp.float32)), grad(layers, batch(1, jnp.float32))
  )
  np.testing.assert_allclose(norm, float(optax.tree.norm(g)), rtol=1e-6)
  u, _ = jax.jit(tx.update)(g, tx.init(layers), layers)
  want = jax.jit(optax.apply_updates)(layers, u)
  moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(want),
              jax.tree.leaves(layers), strict=True))  # fmt: skip
  assert moved > 1e-4, moved  # the step's size, against the tolerance below
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("inner", [lambda: optax.adamw(1e-2, weight_decay=0.1),
                                   lambda: optax.sgd(1e3)], ids=["adamw", "sgd"])  # fmt: skip
def test_bf16_params_with_an_fp32_master(tmp_path, inner):
  """bf16 gradients: optax sums their squares in bf16, the store in float32 (more exact), so
  the norms differ by bf16's rounding; the scale is optax's expression, in bf16. With SGD
  (its step proportional to the scale, large against the tolerance) a wrong scale fails."""
  tail = lambda: offlax.master_weights(inner())
  params, _, stats, *_ = train(str(tmp_path / "s"), chain(SMALL, tail), jnp.bfloat16)
  want, _, norms = optax_run(chain(SMALL, tail), 3, jnp.bfloat16)
  assert all(s.clipped for s in stats)
  np.testing.assert_allclose([s.grad_norm for s in stats], norms, rtol=2**-7)
  f32 = lambda t: [np.asarray(x, np.float32) for x in jax.tree.leaves(t)]
  start = f32(make_layers(jnp.bfloat16))
  moved = max(np.max(np.abs(a - b)) for a, b in zip(f32(want), start, strict=True))
  assert moved > 1e-2, moved  # the steps' size: the norm's rounding (2**-7) moves it by less
  atol = max(1e-3, 2**-6 * moved)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, rtol=2**-7, atol=atol)


@pytest.mark.slow
def test_the_norm_of_gradients_written_before_an_open(tmp_path):
  """A store opened anew knows no sums of squares: `update` reads the gradients once."""
  path, tx = str(tmp_path / "s"), chain(SMALL)
  with offlax.LayerStore.create(path, make_layers(jnp.float32), optimizer=tx,
                                progress=False) as store:  # fmt: skip
    grad(store.source(), batch(0, jnp.float32))
    store.flush_grads()
  like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_layers(jnp.float32))
  with offlax.LayerStore.open(path, like, optimizer=tx, progress=False) as store:
    store.update()
    assert store.last_update.clipped
    np.testing.assert_allclose(store.last_update.grad_norm, optax_run(tx, 1)[2][0], rtol=1e-6)


@pytest.mark.parametrize(
  "tx",
  [
    optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1.0)),
    offlax.master_weights(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
    optax.chain(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
    optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("adam", optax.adam(1e-2))),
  ],
  ids=["not-first", "inside-master-weights", "nested-chain", "named-chain"],
)
def test_a_clip_elsewhere_is_refused_naming_the_way(tmp_path, tx):
  with pytest.raises(errors.InvalidOptionError) as e:
    offlax.LayerStore.create(str(tmp_path / "s"), make_layers(jnp.float32), optimizer=tx)
  msg = str(e.value)
  assert "leaf ['b']" in msg or "leaf ['w']" in msg, msg
  assert "optax.chain(optax.clip_by_global_norm(c), tx)" in msg, msg


@pytest.mark.slow
def test_a_failed_redo_commits_nothing(tmp_path, monkeypatch):
  """The redo (`update="backward"`, the clip applying) cannot read a gradient back: the step
  is dropped, named by layer and leaf, the store at its step; the step run again commits."""
  tx = chain(SMALL)
  store = offlax.LayerStore.create(str(tmp_path / "s"), make_layers(jnp.float32), optimizer=tx,
                                   update="backward", progress=False)  # fmt: skip
  real = slots_lib.Slots.read_slot

  def read_slot(self, kind, gen, k, i):
    if kind == "grads":  # only the redo reads the gradients back in this mode
      raise OSError(errno.EIO, "Input/output error (injected)")
    return real(self, kind, gen, k, i)

  with store:
    before = store.read_params()
    monkeypatch.setattr(slots_lib.Slots, "read_slot", read_slot)
    grad(store.source(), batch(0, jnp.float32))
    with pytest.raises(
      errors.StoreError,
      match=r"step 1 was not committed.* at layer 0, leaf \['b'\] \(the global-norm clip's redo",
    ):
      store.update()
    monkeypatch.setattr(slots_lib.Slots, "read_slot", real)
    assert store.step == 0
    assert_bits(store.read_params(), before)
    grad(store.source(), batch(0, jnp.float32))
    store.update()
    assert store.step == 1 and store.last_update.clipped
    assert_bits(store.read_params(), train(str(tmp_path / "e"), tx, steps=1)[0])


@pytest.mark.slow
def test_killed_at_any_moment_with_a_clip_resumes_one_step(tmp_path):
  """SIGKILL in the backward mode with a clip that applies (kills in the speculated updates,
  the redo, the commit): the store reopens at one whole step, the explicit mode's to the bit."""
  path, rng = str(tmp_path / "s"), np.random.default_rng(1)
  cmd = [sys.executable, os.path.join(HERE, "layer_store_run.py"), path, "backward", "clip"]
  steps = []
  for _ in range(3):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready")
    assert proc.stdout.readline().startswith("committed")  # compiled: the kill lands later
    time.sleep(rng.uniform(0.05, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with offlax.LayerStore.open(path, make_layers_like(), optimizer=clipped()) as store:
      steps.append(store.step)
      params, state, stats, *_ = train(
        str(tmp_path / f"e{len(steps)}"), clipped(), steps=store.step
      )
      assert all(s.clipped for s in stats)
      assert_bits(store.read_params(), params)
      assert_bits(store.read_state(), state)
      assert_bits(store.read_rest(rest_of(0)), rest_of(store.step))
  assert steps == sorted(steps) and steps[-1] > 0, steps


@pytest.mark.parametrize(
  "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)], ids=["f32", "bf16"]
)
def test_the_norm_and_scale_are_optax_s(dtype):
  """Gradients whose squares add exactly (halves and twos): the store's norm, its choice and
  its scaled gradients are optax's to the bit; random ones: the norm to float32's rounding."""
  exact = {"b": jnp.full((L, 4), 2.0, dtype), "w": jnp.full((L, 4, 4), 0.5, dtype)}
  records = [{"dtype": jnp.dtype(dtype).name}] * 2
  for g, c in [(exact, 1.0), (exact, 100.0)]:
    leaves = [np.asarray(x) for x in jax.tree.leaves(g)]
    squares = np.array([[clip_lib.sum_squares(x[i]) for x in leaves] for i in range(L)])
    got = clip_lib.global_norm(squares, records, c)
    norm = optax.tree.norm(g)
    assert got.norm.dtype == norm.dtype and got.norm == norm
    assert got.applies == (not norm < c)
    want, _ = optax.clip_by_global_norm(c).update(g, optax.EmptyState())
    scaled = [clip_lib.scale_gradient(x, got.norm, c) if got.applies else x for x in leaves]
    assert_bits(scaled, want)
  g = jax.tree.map(lambda x: jax.random.normal(jax.random.key(3), x.shape, dtype), exact)
  leaves = [np.asarray(x) for x in jax.tree.leaves(g)]
  squares = np.array([[clip_lib.sum_squares(x[i]) for x in leaves] for i in range(L)])
  rtol = 1e-6 if dtype == jnp.float32 else 2**-8
  np.testing.assert_allclose(
    np.float32(clip_lib.global_norm(squares, records, 1.0).norm),
    np.float32(optax.tree.norm(g)),
    rtol=rtol,
  )


TINY = {"w": jnp.full((4, 8, 8), 0.1, jnp.float32), "b": jnp.zeros((4, 8), jnp.float32)}
G1 = [np.full((8,), 0.5, np.float32), np.ones((8, 8), np.float32)]  # leaves: b, w
G2 = [np.full((8,), -0.25, np.float32), np.full((8, 8), 2.0, np.float32)]


def tiny_clipped(path):
  """A store of 4 tiny layers, the clip applying, an SGD tail (a wrong scale shows)."""
  return offlax.LayerStore.create(str(path), TINY, optimizer=chain(SMALL, lambda: optax.sgd(0.1)),
                                  update="backward", progress=False)  # fmt: skip


def micro_steps(store, last=range(3, -1, -1)):
  """Two micro-steps by hand (the scan's callbacks): G1 added on disk, G2 handed, layers L-1
  down; the last one's layers `last` only."""
  store.source(accumulate=True)
  for i in range(3, -1, -1):
    store.put_grads(micro.Micro(accumulate=True), i, *G1)
  store.flush_grads()
  store.source(accumulate=True, last=True)
  for i in last:
    store.fetch(i)
    store.put_grads(micro.Micro(accumulate=True, last=True), i, *G2)


@pytest.mark.parametrize("drop", ["cut-short", "early-update"])
def test_a_dropped_last_micro_step_refuses_the_sum_it_overwrote(tmp_path, drop):
  """With a clip, the last micro-step's worker writes sum + its gradient over the sum on disk
  (kept for the redo): that step dropped, the sum is gone. Running the last micro-step again
  would count it twice, silently: refused until `zero_grads`; then the step equals one that
  never failed, to the bit."""
  with tiny_clipped(tmp_path / "ok") as store:
    store.zero_grads()
    micro_steps(store)
    store.update()
    assert store.last_update.clipped
    want = store.read_params()
  with tiny_clipped(tmp_path / "s") as store:
    store.zero_grads()
    micro_steps(store, last=(3, 2))  # the backward pass stopped after two layers
    if drop == "early-update":
      with pytest.raises(errors.IncompleteStepError), pytest.warns(
        errors.StepNotCommittedWarning, match=r"zero_grads\(\) and run"
      ):  # fmt: skip
        store.update()
      dropped = contextlib.nullcontext()
    else:  # dropped at the next micro-step's source
      dropped = pytest.warns(errors.StepNotCommittedWarning, match="stopped before handing")
    with dropped, pytest.raises(errors.IncompleteStepError, match=r"would count it twice"):
      store.source(accumulate=True, last=True)
    with pytest.raises(errors.IncompleteStepError, match=r"store.zero_grads\(\) and run"):
      store.source(accumulate=True)  # still, before the last micro-step too
    assert store.step == 0
  with offlax.LayerStore.open(str(tmp_path / "s"), TINY, optimizer=chain(SMALL, lambda: optax.sgd(
      0.1)), update="backward", progress=False) as store:  # fmt: skip
    with pytest.raises(errors.IncompleteStepError, match=r"would count it twice"):
      store.source(accumulate=True, last=True)  # and after the store is opened again
    store.zero_grads()
    micro_steps(store)
    store.update()
    assert store.step == 1
    assert_bits(store.read_params(), want)


def test_a_dropped_step_s_kept_writes_land_before_zero_grads(tmp_path, monkeypatch):
  """A step cut short while its worker's kept gradient is still being written: `zero_grads`
  drops it and waits for that write, so the zeros are the last word (else the late write
  lands in the new sum, silently)."""
  with tiny_clipped(tmp_path / "ok") as store:
    store.zero_grads()
    micro_steps(store)
    store.update()
    want = store.read_params()
  real, writing = slots_lib.Slots.write_raw, threading.Event()

  def slow_write(self, kind, gen, k, i, slot):
    if kind == "grads" and not writing.is_set():  # the kept gradient of layer 3, leaf 0
      writing.set()
      time.sleep(0.5)
    real(self, kind, gen, k, i, slot)

  with tiny_clipped(tmp_path / "s") as store:
    monkeypatch.setattr(slots_lib.Slots, "write_raw", slow_write)
    store.source()
    store.fetch(3)
    store.put_grads(micro.STEP, 3, *G2)  # and the backward pass stops
    assert writing.wait(10)
    with pytest.warns(errors.StepNotCommittedWarning, match="stopped before handing"):
      store.zero_grads()
    micro_steps(store)
    store.update()
    assert_bits(store.read_params(), want)


def test_ctrl_c_in_update_stops_the_clip_s_redo(tmp_path, monkeypatch):
  """Ctrl-C in `update()` while the clip's redo runs (its gradient reads slowed): the redo
  stops at its next unit (the step's abort), rather than updating every layer first."""
  with tiny_clipped(tmp_path / "ok") as store:
    store.source()
    for i in range(3, -1, -1):
      store.fetch(i)
      store.put_grads(micro.STEP, i, *G2)
    store.update()
    want = store.read_params()
  read, write, redo = slots_lib.Slots.read_slot, slots_lib.Slots.write_slot, []

  def slow_read(self, kind, gen, k, i):
    if kind == "grads":  # in this mode only the redo reads the gradients
      redo.append(0)
      time.sleep(0.3)
    return read(self, kind, gen, k, i)

  def counted_write(self, kind, gen, k, i, x):
    if kind == "params" and redo:
      redo.append(1)
    return write(self, kind, gen, k, i, x)

  with tiny_clipped(tmp_path / "s") as store:
    monkeypatch.setattr(slots_lib.Slots, "read_slot", slow_read)
    monkeypatch.setattr(slots_lib.Slots, "write_slot", counted_write)
    store.source()
    for i in range(3, -1, -1):
      store.fetch(i)
      store.put_grads(micro.STEP, i, *G2)
    interrupted(store.update)
    assert store.step == 0
    assert redo.count(1) <= 2, redo  # of 8 units' params: the redo stopped at the next unit
    monkeypatch.setattr(slots_lib.Slots, "read_slot", read)
    store.source()
    for i in range(3, -1, -1):
      store.fetch(i)
      store.put_grads(micro.STEP, i, *G2)
    store.update()
    assert_bits(store.read_params(), want)


def test_a_failed_last_micro_step_says_to_zero_the_sum(tmp_path, monkeypatch):
  """A full disk as the last micro-step's worker keeps a gradient: `update` says the way out
  (the sum is gone: `zero_grads`, the micro-steps again), and the retry is refused."""
  with tiny_clipped(tmp_path / "s") as store:
    store.zero_grads()
    real = slots_lib.Slots.write_raw

    def full(self, kind, gen, k, i, slot):
      if kind == "grads" and i == 1 and armed:
        raise OSError(errno.ENOSPC, "No space left on device")
      real(self, kind, gen, k, i, slot)

    armed = False
    monkeypatch.setattr(slots_lib.Slots, "write_raw", full)
    store.source(accumulate=True)
    for i in range(3, -1, -1):
      store.put_grads(micro.Micro(accumulate=True), i, *G1)
    store.flush_grads()
    armed = True
    store.source(accumulate=True, last=True)
    for i in range(3, -1, -1):
      store.fetch(i)
      store.put_grads(micro.Micro(accumulate=True, last=True), i, *G2)
    with pytest.raises(errors.StoreError, match=r"free space on the disk, then call "
                       r"store.zero_grads\(\) and run the step's micro-steps again"):  # fmt: skip
      store.update()
    with pytest.raises(errors.IncompleteStepError, match="would count it twice"):
      store.source(accumulate=True, last=True)
    assert store.step == 0
