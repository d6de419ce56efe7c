"""CosyVoice WebUI (cosyvoice-opt): the page, its named endpoints and the OpenAI-style HTTP API on one port.

    python app.py [--model-dir D] [--port 7860] [--host 0.0.0.0] [--share] [--precision auto|fp32|fp16|bf16]
                  [--max-batch-size N] [--max-queue-wait S] [--concurrency N] [--auth user:pass|FILE]
                  [--allow-settings] [--random tiny|full] [--family cosyvoice2|cosyvoice3] [--voices-dir D]
                  [--compile] [--speech-tokenizer auto|torch|onnx] [--max-file-size MIB]
                  [--api-key KEY]

`./run.sh` launches this file; `python -m cosyvoice_opt serve` takes the same flags. The WebUI itself lives in
`cosyvoice_opt.webui`. Every mode has a named endpoint for gradio_client users (`/zero_shot`, `/cross_lingual`,
`/instruct2`, `/sft`, `/save_voice`, `/delete_voice`, `/list_voices`); generation events share one queue group of
`--concurrency` slots and the engine batches whatever runs at once. The engine-wide settings (`/set_precision`,
`/set_max_batch_size`, `/set_max_queue_wait`) are read-only unless the server runs with `--auth` (logged-in users
are operators) or `--allow-settings`.
"""

from cosyvoice_opt.webui import main

if __name__ == "__main__":
    main()
