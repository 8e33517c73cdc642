"""Long-sequence extensions for megatron-core: rank grid, attention, schedules, recompute."""
import warnings

# megatron-core warns at import time that Apex / Transformer Engine are missing and it falls back
# to local implementations -- the very modules our local spec uses. Silenced so one-line errors
# and logs stay readable; every other warning still shows. Installed before megatron.core loads.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed.*")
