// Package jsconfig decides whether a JetStream stream or bucket already has
// the configuration a process wants, so that every process can "ensure" its
// streams and buckets at start without rewriting them each time. A needless
// stream update is not free: the server rewrites its store configuration,
// emits an advisory, and (nats-server v2.15.2, seen under the race detector)
// races with consumers being created on the same stream.
package jsconfig

import "reflect"

// Holds reports whether cur already carries every setting want makes: each
// non-zero field of want equals the same field of cur. Zero fields of want
// mean "the server's default" and are not compared, because the server
// reports its defaults filled in (-1 limits, metadata it adds).
func Holds[T any](cur, want T) bool {
	c, w := reflect.ValueOf(cur), reflect.ValueOf(want)
	for i := range w.NumField() {
		if f := w.Field(i); !f.IsZero() && !reflect.DeepEqual(f.Interface(), c.Field(i).Interface()) {
			return false
		}
	}
	return true
}
