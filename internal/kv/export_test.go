package kv

// LoadingMost is the most full copies that loaded at once since the
// last ResetLoadingMost.
func LoadingMost() int64 { return loadingMost.Load() }

func ResetLoadingMost() { loadingMost.Store(0) }
