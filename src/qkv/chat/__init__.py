"""Chat with an instruction model: the conversation kept in the KV cache (conversation), chat
templates from strangers rendered under bounds (sandbox) and in a child process that can be killed
(template_process)."""
