"""Moving hidden states from the inference plane to the trainer: wire format, payload stores
(Mooncake, files), and the control channel that makes the stream exactly-once and ordered."""
