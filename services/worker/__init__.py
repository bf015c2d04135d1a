"""What the prefill and decode workers share, above the engine and the KV-transfer layer:
the start-up and shutdown sequence (`main`) and the wire form of engine types (`wire`)."""
