// Command netprobe runs inside pods of the deployment tests (as an
// ephemeral container, so it shares the pod's network and policies): it
// tries a TCP connection to every host:port argument at once and prints one
// line per target, "open host:port" or "closed host:port: reason".
package main

import (
	"fmt"
	"net"
	"os"
	"sync"
	"time"
)

func main() {
	results := make([]string, len(os.Args)-1)
	var wg sync.WaitGroup
	for i, target := range os.Args[1:] {
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", target, 3*time.Second)
			if err != nil {
				results[i] = fmt.Sprintf("closed %s: %v", target, err)
				return
			}
			c.Close()
			results[i] = "open " + target
		})
	}
	wg.Wait()
	for _, r := range results {
		fmt.Println(r)
	}
}
