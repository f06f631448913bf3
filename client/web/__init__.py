"""The public face of a swarm: `swarm-chat` serves a web chat, an OpenAI-compatible API, a live status page
and Prometheus metrics, as one more client of the swarm (it imports client/ and the DHT reader, never peer code).

    swarm-chat --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/Qm... --port 8000
    # http://127.0.0.1:8000/ chat, /status, /v1/chat/completions, /metrics
"""
