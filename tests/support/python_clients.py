"""Drives guard with the real `ollama` and `openai` Python clients, as users do.

Usage: python3 python_clients.py ollama|openai HOST:PORT
Prints one JSON object with what each call returned, for the Rust test to check.
"""
import json
import sys


def run_ollama(base):
    import ollama

    client = ollama.Client(host=base)
    out = {}
    reply = client.chat(model="smollm2:135m", messages=[{"role": "user", "content": "hi"}])
    out["chat"] = reply.message.content
    out["chat_load_duration"] = reply.load_duration
    chunks = list(client.chat(model="smollm2:135m", messages=[{"role": "user", "content": "hi"}], stream=True))
    out["chat_stream_chunks"] = len(chunks)
    out["chat_stream_done"] = bool(chunks and chunks[-1].done)
    out["generate"] = client.generate(model="smollm2:135m", prompt="hi").response
    out["generate_stream_chunks"] = len(list(client.generate(model="smollm2:135m", prompt="hi", stream=True)))
    out["embed_dims"] = len(client.embed(model="smollm2:135m", input="hello").embeddings[0])
    out["ps_models"] = [m.model for m in client.ps().models]
    try:
        ollama.Client(host=base, headers={"x-guard-class": "vip"}).chat(
            model="smollm2:135m", messages=[{"role": "user", "content": "hi"}]
        )
        out["unknown_class"] = None
    except ollama.ResponseError as err:
        out["unknown_class"] = {"status": err.status_code, "error": err.error}
    return out


def run_openai(base):
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    out = {}
    messages = [{"role": "user", "content": "Say hello."}]
    # llama-server's ignore_eos: the tiny model may otherwise end a reply before any text.
    full = {"ignore_eos": True}
    reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, extra_body=full)
    out["chat"] = reply.choices[0].message.content
    raw = client.chat.completions.with_raw_response.create(model="smollm2", messages=messages, max_tokens=4)
    out["class_header"] = raw.headers.get("x-guard-class")
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, stream=True, extra_body=full)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    out["chat_stream_chunks"] = len(pieces)
    out["chat_stream_text"] = "".join(pieces)
    out["completion"] = client.completions.create(model="smollm2", prompt="Once upon", max_tokens=8, extra_body=full).choices[0].text
    vip = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, default_headers={"x-guard-class": "vip"})
    try:
        vip.chat.completions.create(model="smollm2", messages=messages, max_tokens=4)
        out["unknown_class"] = None
    except openai.APIStatusError as err:
        out["unknown_class"] = {"status": err.status_code, "code": err.body.get("code") if isinstance(err.body, dict) else None, "message": str(err)}
    return out


if __name__ == "__main__":
    which, address = sys.argv[1], sys.argv[2]
    base = f"http://{address}"
    result = run_ollama(base) if which == "ollama" else run_openai(base)
    print(json.dumps(result))
