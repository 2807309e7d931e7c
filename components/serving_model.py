"""MLflow pyfunc model (logged "from code", so loading unpickles nothing): prompts in, completions out.

`mlflow.pyfunc.load_model("models:/NAME@champion").predict(pd.DataFrame({"prompt": [...]}))`
returns one greedy completion per prompt. Self-contained: it imports only torch and transformers,
so the logged model runs without this repository.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel


class CompletionModel(PythonModel):
    """Greedy completion of each prompt with the registered Hugging Face checkpoint."""

    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = context.artifacts["model_dir"]
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
        self.max_new_tokens = int((context.model_config or {}).get("max_new_tokens", 32))

    def predict(self, context, model_input, params=None):
        import torch

        if hasattr(model_input, "columns"):
            prompts = [str(p) for p in model_input["prompt"].tolist()]
        else:
            prompts = [str(p) for p in model_input]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      eos_token_id=self.tokenizer.eos_token_id)
        new_tokens = out[:, enc.input_ids.shape[1]:]
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


mlflow.models.set_model(CompletionModel())
