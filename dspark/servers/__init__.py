"""The peer servers: vLLM's and llama.cpp's OpenAI servers, each a subprocess of its own venv
(outside the main venv), driven over HTTP."""
