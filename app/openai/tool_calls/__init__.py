"""Tool calling on /v1/chat/completions (docs/tool_calling.md): what a request's `tools` and
`tool_choice` mean for the served model (`choice`), the model's tool-call text parsed back into
OpenAI `tool_calls` as it streams (`parse`, `scan`), and marker tokens the detokenizer drops
put back (`markers`)."""
