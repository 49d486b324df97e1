"""One module per store; each exports ``driver`` (a ``keymutex._store.StoreDriver``)."""
