"""exporters: ONNX export of probed models (probes' autograd Functions as ``com.microsoft::PythonOp``).

    import exporters
    exporters.export_onnx(model, (tokens,), "model.onnx")      # standalone, torch 2.4 and 2.13
    exporters.install_for_ort()                               # ORTModule (subscribe() calls it)
    exporters.register_probe_function(MyProbe, describe=...)  # a new probe Function
    with exporters.partitioned_embedding_export(): ...        # DeepSpeed ZeRO-3 (0,) embedding weights
    exporters.ortmodule_threads(1)                            # ORT's intra-op threads, no spinning (ranks per machine)

See docs/exporters.md.
"""

from .embedding import partitioned_embedding_export
from .standalone import export_onnx
from .ort import inference_session, install_for_ort, ortmodule_threads
from .pythonop import ProbeExportWarning, PythonOpExportError
from .registry import register_probe_function

__all__ = [
    "ProbeExportWarning", "PythonOpExportError", "export_onnx", "inference_session", "install_for_ort",
    "ortmodule_threads", "partitioned_embedding_export", "register_probe_function",
]
