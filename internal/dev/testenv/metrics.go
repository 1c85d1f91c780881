package testenv

import (
	"strconv"
	"strings"
)

// MetricSum is the sum of the samples of metric name (exactly that name)
// whose labels include every one of labels, given as name, value pairs;
// a process that is not serving its metrics counts as 0 with the error.
func (pr *Proc) MetricSum(name string, labels ...string) (float64, error) {
	// Every line: a vector nobody has counted in yet has no sample, and
	// counts as 0.
	m, err := pr.Metric("")
	if err != nil {
		return 0, err
	}
	var sum float64
	for _, l := range strings.Split(m, "\n") {
		series, v, ok := strings.Cut(l, " ")
		if !ok {
			continue
		}
		n, set, _ := strings.Cut(series, "{")
		if n != name {
			continue
		}
		have := map[string]bool{}
		for _, kv := range strings.Split(strings.TrimSuffix(set, "}"), ",") {
			have[kv] = true
		}
		match := true
		for i := 0; i+1 < len(labels); i += 2 {
			match = match && have[labels[i]+`="`+labels[i+1]+`"`]
		}
		if f, err := strconv.ParseFloat(v, 64); match && err == nil {
			sum += f
		}
	}
	return sum, nil
}
