"""What ``bench serve`` asks the server before it starts: the model it serves, and the
text of random token IDs.

As ``vllm bench serve`` does: without ``--model`` the first model of
``GET /v1/models`` is named in every request (a server answers 404 for a
name it does not serve), and ``--dataset-name random`` on the chat endpoint
sends each prompt's random token IDs decoded into text (by the server's own
``POST /detokenize``, so with the served model's tokenizer); the server
tokenizes that text again, through the chat template, into about as many tokens.
"""

from __future__ import annotations

from typing import Optional


def _client(base_url: str, api_key: Optional[str]):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=30, trust_env=False)


def served_model(base_url: str, api_key: Optional[str] = None) -> str:
    """The id of the first model ``GET /v1/models`` lists; a ValueError saying why not."""
    import httpx

    try:
        with _client(base_url, api_key) as client:
            r = client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot ask {base_url}/v1/models for the served model "
                         f"({type(e).__name__}: {e}); is the server up? Or give --model")
    models = r.json().get("data") if r.status_code == 200 else None
    if not models:
        raise ValueError(f"{base_url}/v1/models answered HTTP {r.status_code} "
                         f"{r.text[:200]!r} with no model in it; give --model")
    return models[0]["id"]


def decode_prompts(base_url: str, prompts: list[list[int]],
                   api_key: Optional[str] = None) -> list[str]:
    """Each token-ID prompt as text, decoded by the server's ``POST /detokenize``."""
    import httpx

    texts = []
    try:
        with _client(base_url, api_key) as client:
            for ids in prompts:
                r = client.post("/detokenize", json={"tokens": ids})
                if r.status_code != 200:
                    raise ValueError(
                        f"dataset_name='random' with endpoint_type='chat' decodes the random "
                        f"token IDs with the server's /detokenize, which answered HTTP "
                        f"{r.status_code} {r.text[:200]!r}; use --endpoint-type completions "
                        "(token IDs as they are) or a smaller --random-vocab-size")
                texts.append(r.json()["prompt"])
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}/detokenize ({type(e).__name__}: {e})")
    return texts


__all__ = ["served_model", "decode_prompts"]
