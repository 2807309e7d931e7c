"""MLflow pyfunc model (logged "from code", so loading unpickles nothing): prompts in, completions out; or one chat
conversation in, an OpenAI-style answer out.

`mlflow.pyfunc.load_model("models:/NAME@champion").predict(pd.DataFrame({"prompt": [...]}))` returns one greedy
completion per prompt, formatted as in training. `.predict({"messages": [...], "tools": [...]})` (or a POST of the
same JSON to `mlflow models serve`'s /invocations) answers the conversation greedily, laid out token for token as
training's episodes were (the chat template, tools in its own format or in the system message) and read with
training's call parser: an OpenAI `chat.completion` with the calls in `tool_calls`, or the text in `content`
(components/tracking/chat_request.py). Without `tools` it offers the tools the model was trained with.

Self-contained: it imports only torch and transformers (and peft for a LoRA adapter), plus the package `grpo_served`
the model ships (standard-library copies of the pipeline's prompt rendering, chat layout, call parser and request
format), so the logged model runs without this repository. A LoRA adapter version names its base (`base_model_uri`
in the model config, a registered version): loading it loads that base version from the same tracking server and
applies the adapter.
"""

from __future__ import annotations

import json
import os

# The served model phones nobody and draws no progress bars (components/quiet.py, copied: this file runs
# without the repository).
for _key, _value in {"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
                     "HF_HUB_DISABLE_PROGRESS_BARS": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

import mlflow  # noqa: E402 - after the environment above
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.pyfunc import PythonModel  # noqa: E402


class CompletionModel(PythonModel):
    """Greedy completions of prompts, or a greedy answer to a chat conversation, with the registered checkpoint."""

    def load_context(self, context):
        # The shipped package (MLflow's code_paths), imported before a LoRA adapter's base version adds its own.
        from grpo_served import calls, chat, chat_request, prompt_text
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.calls, self.layout, self.requests, self.prompt_text = calls, chat, chat_request, prompt_text
        model_dir = context.artifacts["model_dir"]
        config = context.model_config or {}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if config.get("base_model_uri"):
            from peft import PeftModel

            base = mlflow.pyfunc.load_model(config["base_model_uri"]).unwrap_python_model().model
            self.model = PeftModel.from_pretrained(base, model_dir).merge_and_unload().eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
        self.max_new_tokens = int(config.get("max_new_tokens", 32))
        self.template = config.get("template", "{prompt}")
        self.system = config.get("system")
        self.chat = bool(config.get("chat", False))
        self.start = str(config.get("start") or "")  # plain prompts: the tokenizer's own start ("<bos>"), or ""
        self.tools = json.loads(config.get("tools") or "null") or None  # the schemas of the tools it was trained with
        self.model_name = str(config.get("model_name", "grpo-pipeline"))

    def format(self, record: dict) -> str:
        """Training's own rendering (components/engine/models/prompt_text.py, shipped), with its settings."""
        return self.prompt_text.render(record, self.template, self.system, self.chat, self.start,
                                       self.tokenizer.apply_chat_template)

    def predict(self, context, model_input, params=None):
        if isinstance(model_input, dict):
            records = [model_input]
        elif hasattr(model_input, "columns"):
            records = model_input.to_dict(orient="records")
        else:
            records = [{"prompt": str(p)} for p in model_input]
        if any(isinstance(r.get("messages"), list) for r in records):
            if len(records) != 1:
                raise MlflowException.invalid_parameter_value(
                    f"a chat request holds one conversation (`messages`), not {len(records)}")
            return self.answer(records[0])
        prompts = [self.format({k: v for k, v in r.items() if k not in ("messages", "tools", "max_tokens")})
                   for r in records]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        new_tokens = self._generate(enc.input_ids, enc.attention_mask, self.max_new_tokens)
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)

    def answer(self, request: dict) -> dict:
        """One conversation's OpenAI-style answer: the model's next turn, its calls parsed as training parsed them."""
        import torch

        try:
            messages = self.requests.episode_messages(request.get("messages"))
            tools = self.requests.offered_tools(request.get("tools"), self.tools)
            limit = self.requests.max_tokens(request.get("max_tokens"), self.max_new_tokens)
            ids = self.chat_ids(messages, tools)
        except ValueError as err:  # RequestError, or a chat template that cannot lay the conversation out
            raise MlflowException.invalid_parameter_value(str(err)) from err
        prompt = torch.tensor([ids])
        written = self._generate(prompt, torch.ones_like(prompt), limit)[0].tolist()
        eos = self.tokenizer.eos_token_id
        ended = eos in written
        written = written[: written.index(eos) + 1] if ended else written
        text = self.tokenizer.decode([t for t in written if t != eos], skip_special_tokens=True)
        return self.reply(text, ended, tools, (len(ids), len(written)))

    def reply(self, text: str, ended: bool, tools: list | None, usage: tuple) -> dict:
        """The answer to send for a turn the model wrote: with tools offered, its calls read by training's parser
        (components/engine/generation/environments/calls.py) into `tool_calls`; otherwise, or when a call cannot be
        read, or the turn ran out of tokens (as in training, half a turn is not read for calls), the text as written, in
        `content`."""
        parsed = self.calls.parse_tool_calls(text, self.tokenizer) if tools and ended else None
        if parsed is None or parsed.malformed is not None or not parsed.calls:
            return self.requests.chat_completion(text, [], ended, usage, self.model_name)
        return self.requests.chat_completion(self.calls.CALL.sub("", text).strip(),
                                             [(c.name, c.arguments) for c in parsed.calls], ended, usage,
                                             self.model_name)

    def chat_ids(self, messages: list, tools: list | None) -> list:
        """The conversation's token ids as training laid an episode out
        (components/engine/generation/environments/chat.py): the system message (the request's, else the one trained
        with) with the tools described in it where the chat template has no tool format of its own, each assistant turn
        as the model writes it, through the generation prompt of the turn to answer."""
        if not self.chat:
            raise ValueError("this model was trained on prompts without a chat template; send `prompt`, not `messages`")
        layout = self.layout.ChatFormat(self.tokenizer, tools)
        own = messages[0]["role"] == "system"
        system = layout.system_text(messages[0]["content"] if own else self.system,
                                    self.layout.tools_text(tools) if tools else None)
        rest = messages[1:] if own else messages
        head = [{"role": "system", "content": system}] if system else []
        return self.layout.conversation_ids(layout, head + rest)[0]

    def _generate(self, input_ids, attention_mask, max_new_tokens: int):
        """The greedily written tokens after each (left-padded) row."""
        import torch

        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.tokenizer.eos_token_id)
        return out[:, input_ids.shape[1]:]


mlflow.models.set_model(CompletionModel())
