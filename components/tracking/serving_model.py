"""MLflow pyfunc model (logged "from code", so loading unpickles nothing): prompts in, completions out.

`mlflow.pyfunc.load_model("models:/NAME@champion").predict(pd.DataFrame({"prompt": [...]}))`
returns one greedy completion per prompt. Self-contained: it imports only torch and transformers
(and peft for a LoRA adapter), so the logged model runs without this repository. A LoRA adapter version
names its base (`base_model_uri` in the model config, a registered version): loading it loads that base
version from the same tracking server and applies the adapter.
"""

from __future__ import annotations

import os

# The served model phones nobody and draws no progress bars (components/quiet.py, copied: this file runs
# without the repository).
for _key, _value in {"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
                     "HF_HUB_DISABLE_PROGRESS_BARS": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
                     "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

import mlflow  # noqa: E402 - after the environment above
from mlflow.pyfunc import PythonModel  # noqa: E402


class CompletionModel(PythonModel):
    """Greedy completion of each prompt with the registered Hugging Face checkpoint."""

    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

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

    def format(self, record: dict) -> str:
        """The same formatting the pipeline trained with (components/engine/models/prompting.py)."""
        text = self.template.format(**record)
        if self.chat:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + \
                       [{"role": "user", "content": text}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return f"{self.system}\n{text}" if self.system else text

    def predict(self, context, model_input, params=None):
        import torch

        if hasattr(model_input, "columns"):
            records = model_input.to_dict(orient="records")
        else:
            records = [{"prompt": str(p)} for p in model_input]
        prompts = [self.format(r) for r in records]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.tokenizer.eos_token_id)
        new_tokens = out[:, enc.input_ids.shape[1]:]
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


mlflow.models.set_model(CompletionModel())
