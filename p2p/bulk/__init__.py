"""The bulk data plane: encrypted frames (``frames``, sans-IO), the shared transfer pieces and
loops (``transfer``), data connections dialed, punched or accepted (``connect``, ``listener``),
and the channel and one-shot transfers built on them (``channel``).
"""
