"""What records call the model itself: the root module has no qualified name of its own.

    from probes.utils.names import ROOT_NAME
    name = qualified or ROOT_NAME         # "<root>.output.0" is the model's first output
"""

ROOT_NAME = "<root>"
