"""Adapter downloads through the official `tinker` SDK: `python -m` this module URL KEY MODEL OUT.

`save_weights_external` exports the adapter; `RestClient.get_external_weights_urls` signs a URL
per file, fetched here with plain urllib and no key, as the SDK's own download does; the
official `tinker checkpoint download` command fetches a training checkpoint (exporting it through
a temporary training client, then deleting the export) with the same download code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import tinker

types = tinker.types


def _datum(tokens: list[int]) -> Any:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _cli(*args: str, url: str, key: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": key}
    command = [sys.executable, "-c", "from tinker.cli.__main__ import cli; cli()", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def run(url: str, key: str, model: str, out: str) -> None:
    root = Path(out)
    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=model, rank=4, seed=1)
    training.forward_backward([_datum([5, 17, 33, 90])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=0.01)).result()
    state = training.save_state("w1").result().path
    sampler = training.save_weights_for_sampler("s1").result().path
    export = training.save_weights_external("e1").result().path
    assert export == f"tinker://{training.model_id}/external_weights/e1", export

    rest = service.create_rest_client()
    signed = rest.get_external_weights_urls(export).result()
    assert "adapter_config.json" in signed.urls, signed.urls
    fetched = {}
    for name, file_url in signed.urls.items():
        with urllib.request.urlopen(file_url, timeout=30) as response:  # no API key
            fetched[name] = response.read()
    kinds = {
        c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints
    }
    assert kinds[export].checkpoint_type == "external", kinds[export]

    done = _cli("checkpoint", "download", state, "--output", str(root / "state"), url=url, key=key)
    assert done.returncode == 0, done.stdout + done.stderr
    [folder] = list((root / "state").iterdir())
    # The same adapter as the export made at the same step (no optimizer state).
    assert _files(folder) == fetched, sorted(_files(folder))
    left = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    assert not any(p.endswith("/external_weights/download") for p in left), left

    try:  # the SDK refuses a sampler checkpoint itself; the server would too (400)
        rest.get_external_weights_urls(sampler)
    except ValueError:
        pass
    else:
        raise AssertionError("a sampler checkpoint was accepted for download")
    service.close("success").result()
    print("official SDK download flow: OK")


if __name__ == "__main__":
    run(*sys.argv[1:5])
