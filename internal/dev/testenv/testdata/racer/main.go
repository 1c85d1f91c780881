// Command racer races on purpose: testenv's test starts it to check that a
// data race in a child process fails the test that started it.
package main

import "fmt"

func main() {
	n := 0
	done := make(chan struct{})
	go func() { n++; close(done) }()
	n++
	<-done
	fmt.Println("raced", n)
}
