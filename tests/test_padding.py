"""Padding helpers against plain-Python references on random cases."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_ppo import padding

PAD = 0
STOP = 13


def _ref_pack(tokens, mask, pad_id, to_right):
    out_t, out_m = [], []
    for row_t, row_m in zip(tokens.tolist(), mask.tolist()):
        real = [t for t, m in zip(row_t, row_m) if m]
        pads = [pad_id] * (len(row_t) - len(real))
        if to_right:
            out_t.append(pads + real)
            out_m.append([False] * len(pads) + [True] * len(real))
        else:
            out_t.append(real + pads)
            out_m.append([True] * len(real) + [False] * len(pads))
    return np.array(out_t, np.int32), np.array(out_m, bool)


def _ref_first_true(mask, default):
    out = []
    for row in mask.tolist():
        idx = default
        for i, m in enumerate(row):
            if m:
                idx = i
                break
        out.append(idx)
    return np.array(out, np.int32)


def _ref_truncate(tokens, stop, min_index, pad_id):
    out, found = [], []
    for row in tokens.tolist():
        stop_at = None
        for i in range(min_index, len(row)):
            if row[i] == stop:
                stop_at = i
                break
        if stop_at is None:
            out.append(list(row))
        else:
            out.append(row[:stop_at + 1] + [pad_id] * (len(row) - stop_at - 1))
        found.append(stop_at is not None)
    return np.array(out, np.int32), np.array(found, bool)


def _ref_positions(mask):
    out = []
    for row in mask.tolist():
        count, pos = 0, []
        for m in row:
            pos.append(count)
            count += int(m)
        out.append(pos)
    return np.array(out, np.int32)


def _random_masks(rng, batch, length, kind):
    """Masks of a given layout; the first row is all pad, the last has none."""
    n = rng.integers(0, length + 1, size=batch)
    n[0], n[-1] = 0, length
    pos = np.arange(length)[None, :]
    if kind == "prefix":
        return pos < n[:, None]
    if kind == "suffix":
        return pos >= length - n[:, None]
    mask = rng.random((batch, length)) < rng.random((batch, 1))
    mask[0], mask[-1] = False, True
    return mask


# Few distinct shapes (each shape costs a compilation), many random rows each.
SHAPES = ((3, 1), (64, 7), (64, 24))


def _cases(kinds=("prefix", "suffix", "random")):
    rng = np.random.default_rng(0)
    for batch, length in SHAPES:
        for kind in kinds:
            mask = _random_masks(rng, batch, length, kind)
            # Pad positions hold junk ids so the helpers must overwrite them.
            tokens = rng.integers(1, 50, size=(batch, length)).astype(np.int32)
            yield tokens, mask


MODES = [pytest.param(False, id="eager"), pytest.param(True, id="jit")]


@pytest.mark.parametrize("use_jit", MODES)
@pytest.mark.parametrize("to_right", [True, False])
def test_pack_matches_reference(use_jit, to_right):
    fn = (padding.right_to_left_padding if to_right
          else padding.left_to_right_padding)
    fn = jax.jit(fn, static_argnums=2) if use_jit else fn
    for tokens, mask in _cases():
        got_t, got_m = fn(jnp.asarray(tokens), jnp.asarray(mask), PAD)
        want_t, want_m = _ref_pack(tokens, mask, PAD, to_right)
        np.testing.assert_array_equal(np.asarray(got_t), want_t)
        np.testing.assert_array_equal(np.asarray(got_m), want_m)
        assert got_t.dtype == jnp.int32 and got_m.dtype == jnp.bool_


def test_round_trip():
    for tokens, mask in _cases(kinds=("prefix",)):
        left_t, left_m = padding.right_to_left_padding(tokens, mask, PAD)
        back_t, back_m = padding.left_to_right_padding(left_t, left_m, PAD)
        want_t, _ = _ref_pack(tokens, mask, PAD, to_right=False)
        np.testing.assert_array_equal(np.asarray(back_t), want_t)
        np.testing.assert_array_equal(np.asarray(back_m), mask)


@pytest.mark.parametrize("use_jit", MODES)
def test_first_true_index(use_jit):
    fn = jax.jit(padding.first_true_index, static_argnums=1) if use_jit else (
        padding.first_true_index)
    for _, mask in _cases():
        length = mask.shape[1]
        np.testing.assert_array_equal(
            np.asarray(fn(jnp.asarray(mask))), _ref_first_true(mask, length))
        got = fn(jnp.asarray(mask), -1)
        np.testing.assert_array_equal(np.asarray(got),
                                      _ref_first_true(mask, -1))
        assert got.dtype == jnp.int32


@pytest.mark.parametrize("use_jit", MODES)
def test_truncate_after_stop(use_jit):
    fn = padding.truncate_after_stop
    if use_jit:
        # min_index traced, to check it need not be static.
        fn = jax.jit(fn, static_argnums=(1, 3))
    rng = np.random.default_rng(1)
    for batch, length in SHAPES:
        tokens = rng.integers(1, 20, size=(batch, length)).astype(np.int32)
        # Sprinkle stop tokens with a per-row density; the first row has none.
        density = rng.random((batch, 1)) * 0.4
        tokens[rng.random((batch, length)) < density] = STOP
        tokens[0] = np.where(tokens[0] == STOP, 1, tokens[0])
        for min_index in sorted({0, 1, int(rng.integers(0, length + 1)),
                                 length // 2, length}):
            got_t, found = fn(jnp.asarray(tokens), STOP, min_index, PAD)
            want_t, want_found = _ref_truncate(tokens, STOP, min_index, PAD)
            np.testing.assert_array_equal(np.asarray(got_t), want_t)
            np.testing.assert_array_equal(np.asarray(found), want_found)
            assert found.dtype == jnp.bool_


def test_truncate_ignores_stop_before_min_index():
    tokens = jnp.array([[STOP, 5, 6, 7, 8, 9],       # only before min_index
                        [5, STOP, 6, STOP, 8, 9],    # before and after
                        [5, 6, 7, 8, 9, STOP],       # last position
                        [5, 6, 7, STOP, 9, 9]],      # at min_index
                       jnp.int32)
    got, found = padding.truncate_after_stop(tokens, STOP, 3, PAD)
    np.testing.assert_array_equal(np.asarray(got), [
        [STOP, 5, 6, 7, 8, 9],
        [5, STOP, 6, STOP, PAD, PAD],
        [5, 6, 7, 8, 9, STOP],
        [5, 6, 7, STOP, PAD, PAD]])
    np.testing.assert_array_equal(np.asarray(found), [False, True, True, True])
    scores = jnp.array([0.5, 1.5, -2.0, 3.0], jnp.float32)
    np.testing.assert_allclose(
        np.asarray(padding.penalize_missing_stop(scores, found, -1.0)),
        [-1.0, 1.5, -2.0, 3.0])


@pytest.mark.parametrize("use_jit", MODES)
def test_position_ids(use_jit):
    fn = jax.jit(padding.position_ids_from_mask) if use_jit else (
        padding.position_ids_from_mask)
    for _, mask in _cases():
        got = fn(jnp.asarray(mask))
        np.testing.assert_array_equal(np.asarray(got), _ref_positions(mask))
        assert got.dtype == jnp.int32
    left = jnp.array([[False, False, True, True, True]])
    np.testing.assert_array_equal(
        np.asarray(padding.position_ids_from_mask(left)), [[0, 0, 0, 1, 2]])


def _primitive_names(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    names |= _primitive_names(sub)
    return names


@pytest.mark.parametrize("fn", [padding.right_to_left_padding,
                                padding.left_to_right_padding])
def test_no_sort_in_jaxpr(fn):
    tokens = jnp.zeros((4, 16), jnp.int32)
    mask = jnp.zeros((4, 16), bool)
    closed = jax.make_jaxpr(lambda t, m: fn(t, m, PAD))(tokens, mask)
    names = _primitive_names(closed.jaxpr)
    assert "scatter" in names or "gather" in names
    assert not any("sort" in name for name in names), names
