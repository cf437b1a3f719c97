"""skip_on_spike (transforms.spike): spikes become skipped steps."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradclip_jax import SkipOnSpikeState, ZClipState, autoclip, skip_on_spike, zclip
from tests.transforms.feeding import feed as _feed


def test_skip_on_spike_zeroes_spikes_only():
    tx = skip_on_spike(zclip(z_thresh=2.0, warmup_steps=3))
    outs, states = _feed(tx, [1.0, 1.1, 0.9, 1.05, 10.0, 1.0])
    assert outs[4] == 0.0 and all(o > 0.5 for i, o in enumerate(outs) if i != 4)
    assert [bool(s.skipped) for s in states] == [False] * 4 + [True, False]
    assert int(states[-1].num_skipped) == 1
    assert isinstance(states[-1], SkipOnSpikeState) and isinstance(
        states[-1].inner_state, ZClipState
    )


def test_skip_on_spike_field_and_chain():
    with pytest.raises(ValueError, match="spike"):
        skip_on_spike(autoclip()).init(jnp.zeros(2))
    with pytest.raises(ValueError, match="clipped"):  # two clippers: ambiguous
        skip_on_spike(optax.chain(autoclip(), zclip()), field="clipped").init(jnp.zeros(2))
    tx = skip_on_spike(autoclip(percentile=50.0), field="clipped")
    outs, _ = _feed(tx, [1.0, 2.0, 0.5])
    np.testing.assert_allclose(outs, [1.0, 0.0, 0.5], rtol=1e-6)
    # the whole chain: the parameters do not move on a spike
    tx = skip_on_spike(optax.chain(zclip(warmup_steps=2, z_thresh=2.0), optax.sgd(1.0)))
    outs, _ = _feed(tx, [1.0, 1.2, 50.0, 1.0])
    assert outs[2] == 0.0 and outs[3] > 0
