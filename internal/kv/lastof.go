package kv

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// MaxLastOf is the most entries LastOf returns: the server's own bound on
// one batched read.
const MaxLastOf = 1024

// ErrTooMany: the filters match more keys than one LastOf returns.
var ErrTooMany = errors.New("more keys match than one read returns")

// LastOf reads the newest entry of every key matching one of filters
// (subject-style wildcards: "bob.*"), deleted keys left out, in one
// request the server answers from its index of subjects (a batched direct
// get, "multi_last"): what matches decides its cost, not the size of the
// bucket, where a watch with several filters makes the server look
// through every subject it holds. More than MaxLastOf matching keys is
// ErrTooMany.
func (b *Bucket[T]) LastOf(ctx context.Context, filters ...string) ([]Entry[T], error) {
	subjects := make([]string, len(filters))
	for i, f := range filters {
		subjects[i] = "$KV." + b.name + "." + f
	}
	msgs, err := LastMsgs(ctx, b.js.Conn(), "KV_"+b.name, subjects...)
	if err != nil {
		return nil, err
	}
	var out []Entry[T]
	prefix := "$KV." + b.name + "."
	for _, m := range msgs {
		if op := m.Header.Get("KV-Operation"); op == "DEL" || op == "PURGE" || m.Header.Get(jetstream.MarkerReasonHeader) != "" {
			continue
		}
		e, err := b.rawEntry(m, prefix)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", b.name, err)
		}
		out = append(out, e)
	}
	return out, nil
}

// LastMsgs reads the newest message of every subject of stream matching
// one of subjects (wildcards allowed), in one batched direct get
// ("multi_last"; the stream allows direct gets): the matching subjects
// decide its cost, not the stream's size. Each message carries its
// subject, sequence and time stamp in the direct get's headers. More than
// MaxLastOf matching subjects is ErrTooMany.
func LastMsgs(ctx context.Context, nc *nats.Conn, stream string, subjects ...string) ([]*nats.Msg, error) {
	if len(subjects) == 0 {
		return nil, nil
	}
	what := fmt.Sprintf("read %s/%s", stream, strings.Join(subjects, ","))
	req, err := json.Marshal(struct {
		MultiLast []string `json:"multi_last"`
		Batch     int      `json:"batch"`
	}{subjects, MaxLastOf})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := nc.PublishRequest("$JS.API.DIRECT.GET."+stream, inbox, req); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	var out []*nats.Msg
	for {
		m, err := sub.NextMsgWithContext(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		switch status := m.Header.Get("Status"); status {
		case "":
			out = append(out, m)
		case "204": // the end of the batch
			return out, nil
		case "404": // nothing matches
			return nil, nil
		case "413":
			return nil, fmt.Errorf("%s: %w", what, ErrTooMany)
		default:
			return nil, fmt.Errorf("%s: the server answered %s %s", what, status, m.Header.Get("Description"))
		}
	}
}

// rawEntry is a direct get's answer as an entry.
func (b *Bucket[T]) rawEntry(m *nats.Msg, prefix string) (Entry[T], error) {
	key, ok := strings.CutPrefix(m.Header.Get(jetstream.SubjectHeader), prefix)
	if !ok {
		return Entry[T]{}, fmt.Errorf("an answer for subject %q", m.Header.Get(jetstream.SubjectHeader))
	}
	seq, err := strconv.ParseUint(m.Header.Get(jetstream.SequenceHeader), 10, 64)
	if err != nil {
		return Entry[T]{}, fmt.Errorf("%s: sequence: %w", key, err)
	}
	var v T
	if err := decodeInto(m.Data, &v); err != nil {
		return Entry[T]{}, fmt.Errorf("decode %s/%s: %w", b.name, key, err)
	}
	return Entry[T]{Key: key, Value: v, Revision: seq}, nil
}
