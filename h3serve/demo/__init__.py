"""A procedural world of coloured shapes, moves and tones for MiniMax-H3: its scenes and prompts, analytic
judges of a clip, and ``h3serve eval``, which generates held-out scenes through the serving engine and
judges them (``world``, ``detectors``, ``evaluate``)."""
