"""What goes over loopd's socket: the messages (`proto`), the events of a turn (`events`) and
the framing of JSON lines under a cap (`lines`). A client imports this and `loopd.session`'s
records, and nothing of the daemon."""
