"""How a row plays (`episodes.py`): a single turn, or the user's tools or environment answering the model's turns;
tool schemas and calls, the chat layout and the environment protocol users write against. The service
(`../service.py`) plays every row through the rollout door's decoding runs turn by turn; engines never know about
tools."""
