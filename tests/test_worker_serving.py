"""The worker serves the model it has loaded: one model in memory for the window and the API."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from app.engine import messages as M  # noqa: E402
from app.engine.worker import WorkerClient, WorkerError  # noqa: E402

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def test_worker_serves_its_loaded_model(smollm2_path):
    with WorkerClient() as c:
        with pytest.raises(WorkerError, match="load a model"):
            c.serve(port=0)
        info = c.load(str(smollm2_path))
        s = c.serve(port=0)
        assert isinstance(s, M.Serving) and s.url.startswith("http://127.0.0.1:") and not s.error
        api = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0)
        assert [m.id for m in api.models.list()] == [info["name"]]
        r = api.chat.completions.create(model=info["name"], messages=PARIS, temperature=0,
                                        max_tokens=30)  # fmt: skip
        assert "Paris" in r.choices[0].message.content
        # the window's own generation still runs while serving, on the same model
        done = [m for m in c.generate(PARIS, {"max_tokens": 30}) if isinstance(m, M.Done)]
        assert "Paris" in done[0].text
        # loading again keeps serving, on the same address
        c.load(str(smollm2_path))
        again = c._wait(lambda m: isinstance(m, M.Serving), 60)
        assert again.url == s.url
        assert (
            "Paris"
            in api.chat.completions.create(
                model=info["name"], messages=PARIS, temperature=0, max_tokens=30
            )
            .choices[0]
            .message.content
        )
        assert c.stop_serving().url == ""
        with pytest.raises(openai.APIConnectionError):
            api.models.list()
