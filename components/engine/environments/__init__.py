"""Tools and environments, and the one generation service every caller uses (`generation.py`): every row is an
episode, played through the rollout door's decoding runs turn by turn; engines never know about tools."""
