"""Static checks of an EAGLE-3 draft (and of the draft against its target) before an engine loads it.

Used by the vLLM plugin at engine start and by `kimi-eagle doctor`. Pure Python at import: torch is imported
only by the functions that load the draft's tensors.
"""

from kimi_eagle.checks.diagnosis import Diagnosis, diagnose, run_static_checks
from kimi_eagle.checks.findings import Finding, Severity, refusal_message, worst

__all__ = ["Diagnosis", "Finding", "Severity", "diagnose", "refusal_message", "run_static_checks", "worst"]
