"""The simulated engine's step timing: the calibration, and a fleet file's ``sim`` block as the
latency model (the one place that converts it).

A simulated engine times its steps with the profiles' latency model
(``narwhal.profiles.models.EngineModels``) in the modelled fleet's seconds: a step prefills
chunks (``prefill.a`` once, plus each chunk's ``prefill.chunk_seconds(offset, n) - prefill.a``)
and advances a batch by one token (``decode.seconds_per_token(batch, mean context)``), and takes
``wall()`` of their sum. These are the forms narwhal-profile fits, so a profile of the simulator
should recover these very parameters, in wall seconds (``EngineModels.in_wall_seconds()``).

``CALIBRATION`` (model seconds): 8,192-token prefill = 0.02 + 0.8192 + 0.0805 = 0.92 s; decode
at batch 1 with 512 to 8,192 tokens of context = 0.2416 to 0.2426 s per token, as measured on
the MI355X fleet. Its ranges are the engines' limits (chunks up to ``max_num_batched_tokens``
8,192, batches up to ``max_num_seqs`` 64, contexts up to twice the chunk): where predictions
made from it are flagged as extrapolated. The fleet file's ``sim`` block defaults to the same
numbers (``narwhal.contract.SimulatedEngineSettings``; a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import replace

from narwhal.contract import SimulatedEngineSettings
from narwhal.profiles.models import DecodeLatencyModel, EngineModels, PrefillLatencyModel

__all__ = ["CALIBRATION", "sim_models"]

CALIBRATION = EngineModels(
    prefill=PrefillLatencyModel(a=0.02, b=1.0e-4, c=1.2e-9, min_tokens=1, max_tokens=8192),
    decode=DecodeLatencyModel(
        intercept=0.2400, slope=0.0015, ctx_coef=1.3e-7, max_batch=64, max_context=16384
    ),
)


def sim_models(sim: SimulatedEngineSettings | None) -> EngineModels:
    """The latency model of a simulated engine with these ``sim`` settings (the calibration
    when there are none): their coefficients, time scale and slowdown."""
    if sim is None:
        return CALIBRATION
    return replace(
        CALIBRATION,
        prefill=replace(CALIBRATION.prefill, a=sim.prefill_a, b=sim.prefill_b, c=sim.prefill_c),
        decode=replace(
            CALIBRATION.decode,
            intercept=sim.decode_intercept,
            slope=sim.decode_slope,
            ctx_coef=sim.decode_ctx_coef,
        ),
        time_scale=sim.time_scale,
        slowdown=sim.slowdown,
    )
