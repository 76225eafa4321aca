"""The OpenAI-compatible HTTP server: ``protocol`` (what a request may hold, what an answer
looks like), ``limits`` (what a connection may cost), ``tokenizer`` (text in and out) over
``chat_template`` (the bounded chat-template sandbox), and ``server`` (the routes)."""
