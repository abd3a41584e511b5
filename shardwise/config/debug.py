"""The ``[debug]`` section: what a run records to explain itself, and the faults it plants on
purpose for the tests of its guards."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DebugConfig:
    deterministic: bool = False
    """Use deterministic kernels (torch.use_deterministic_algorithms) for bit-reproducible runs."""
    comm: bool = False
    """Print (and write comm.json) every collective of step debug.trace_step, with its bytes."""
    memory: bool = False
    """Write step debug.trace_step's live-tensor peak per rank by category (MemTracker): memory_peak.json."""
    trace_step: int = 1
    """The step debug.comm and debug.memory record (2 or later: the steady state)."""
    nan_step: int = 0
    """Fault injection: make step N's loss NaN on every rank (tests training.nonfinite); 0 = off."""
    spike_step: int = 0
    """Fault injection: step N's batch becomes random tokens (tests training.spike); 0 = off."""
    fail_step: int = 0
    """Fault injection: SIGKILL rank debug.fail_rank at step N of the first attempt; 0 = off."""
    fail_rank: int = 0
    """The rank that debug.fail_step kills."""
    routing_record: bool = False
    """MoE, one rank: write each layer's expert choices per token to run.dir/routing/ (verify)."""
    routing_replay: str = ""
    """MoE: route tokens as this run.dir's routing_record trace did, count own choices that differ."""
    tp_rounding: int = 0
    """One rank: round as tensor parallel over N ranks does (verify's noise floor); 0 = off."""
    capture: str = ""
    """Save step debug.trace_step's module outputs (residual-shaped) and full gradients to this
    directory, one file per rank (``verify --localize`` compares them with the reference's)."""
    trace: str = ""
    """Write each step's signature of every module output and gradient (norm, hash of the bytes) to
    this file, per rank (``shardwise compare A B`` names where two traces first differ); "" = off."""
