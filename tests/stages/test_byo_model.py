"""Bring your own model: a random-initialised Qwen2 with a chat template, built offline, through the
whole pipeline with chat formatting and LoRA; and a hub id refused offline with a clear message."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import BIN, copy_committed_project, run

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tiny_qwen(out, texts):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from components.engine.models.modeling import build_char_tokenizer

    tok = build_char_tokenizer(list(texts) + ["<|system|><|user|><|assistant|> "])
    tok.chat_template = CHAT_TEMPLATE
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=96,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)


@pytest.mark.slow
def test_qwen2_with_chat_template_and_lora_end_to_end(tmp_path, prefect_home):
    from components.data.records import dir_md5

    repo = copy_committed_project(tmp_path / "repo")
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(0, 40, 3) for b in range(0, 40, 7)]
    (repo / "data" / "user" / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_dir = tmp_path / "tiny-qwen2"
    build_tiny_qwen(model_dir, [r["question"] + r["answer"] for r in rows] + ["Add the numbers."])
    base_md5 = dir_md5(model_dir)
    env = {"MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}", "PREFECT_HOME": prefect_home(tmp_path / "prefect")}
    overrides = [
        f"model.name_or_path={model_dir}", "data.train_path=data/user/qa.jsonl", "data.columns={question: prompt}",
        "data.heldout_ratio=0.25", "prompt.chat_template=always", "prompt.system=Add the numbers.",
        "sft.enabled=false", "grpo.lora.enabled=true", "grpo.lora.target_modules=[q_proj, v_proj]",
        "grpo.steps=4", "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.max_completion_length=4",
        "grpo.checkpoint_every=2", "grpo.log_every=2", "evaluate.max_new_tokens=4", "evaluate.bootstrap_samples=200",
        "register.model_name=tiny-qwen2-chat", "threads=1",
        "register.require_improvement=false",  # 4 steps need not beat the start; this test is about the model
    ]
    proc = run([str(BIN / "grpo-pipeline"), "run"] + [x for o in overrides for x in ("--set", o)], repo, env=env)
    assert "registered model: models:/tiny-qwen2-chat/1 -> champion" in proc.stdout
    # models/grpo is the adapter alone, its base named; the registry links the adapter to that base.
    grpo_files = {p.name for p in (repo / "models" / "grpo").iterdir()}
    assert "adapter_model.safetensors" in grpo_files and "model.safetensors" not in grpo_files, grpo_files
    assert json.loads((repo / "models" / "grpo" / "provenance.json").read_text())["base_model"] == str(model_dir)
    assert dir_md5(model_dir) == base_md5, "the user's model directory must never be written"
    # Validation counted tokens of the chat-formatted prompts, not the raw ones.
    assert (repo / "metrics" / "validation.json").exists()

    check = """
import mlflow, pandas as pd, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = mlflow.pyfunc.load_model("models:/tiny-qwen2-chat@champion")
config = model.model_config
assert config["chat"] is True and config["system"] == "Add the numbers.", config
served = model.predict(pd.DataFrame({"prompt": ["3+4="]}))
from components.engine.models.modeling import load_model
tok = AutoTokenizer.from_pretrained("models/grpo"); tok.padding_side = "left"
lm = load_model("models/grpo", torch.device("cpu"))
version = mlflow.MlflowClient().get_model_version_by_alias("tiny-qwen2-chat", "champion")
assert version.tags["model.kind"] == "lora-adapter"
assert version.tags["base.model_uri"] == "models:/tiny-qwen2-chat-base/1"
assert config["base_model_uri"] == "models:/tiny-qwen2-chat-base/1", config
text = tok.apply_chat_template([{"role": "system", "content": "Add the numbers."}, {"role": "user", "content": "3+4="}],
                               tokenize=False, add_generation_prompt=True)
assert text.endswith("<|assistant|>"), text
enc = tok([text], return_tensors="pt", add_special_tokens=False)
out = lm.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id)
direct = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
assert list(served) == direct, (served, direct)
print("SERVED", list(served))
"""
    result = run([sys.executable, "-c", check], repo, env=env)
    assert "SERVED [" in result.stdout


def test_hub_id_offline_gives_a_clear_error_not_a_traceback(tmp_path):
    repo = copy_committed_project(tmp_path / "repo")
    proc = run([str(BIN / "grpo-pipeline"), "run", "--set", "model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct"], repo,
               env={"HF_HUB_OFFLINE": "1"}, check=False)
    assert proc.returncode == 2
    assert "model path Qwen/Qwen2.5-0.5B-Instruct does not exist" in proc.stdout
    assert "download it first" in proc.stdout and "Traceback" not in proc.stdout
    assert "name_or_path: null" in (repo / "params.yaml").read_text()  # nothing was written
