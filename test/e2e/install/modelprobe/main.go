// Command modelprobe is a hostile agent for the deployment tests: run as
// an ephemeral container in a sandbox pod (so it has the pod's network
// and its restricted security context), it calls the model broker as
// itself and as another user every way a tenant could try, and tries to
// leave its own address. It prints one line per attempt, "<name> <result>
// <detail>", which the test reads from the container's log.
//
//	modelprobe <broker base URL, e.g. http://aaas-broker.aaas.svc:8090/deepseek> <model> <another pod's IP>
package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: modelprobe <base URL> <model> <another pod's IP>")
		os.Exit(2)
	}
	base, model, other := os.Args[1], os.Args[2], os.Args[3]
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"probe"}],"user":"bob"}`, model)
	call := func(name string, header map[string]string, dialer *net.Dialer) {
		if dialer == nil {
			dialer = &net.Dialer{Timeout: 5 * time.Second}
		}
		c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: dialer.DialContext}}
		req, _ := http.NewRequest(http.MethodPost, base+"/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := c.Do(req)
		if err != nil {
			fmt.Printf("%s error %v\n", name, oneLine(err.Error()))
			return
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		resp.Body.Close()
		fmt.Printf("%s %d %s\n", name, resp.StatusCode, oneLine(string(b)))
	}
	call("as-itself", map[string]string{"Authorization": "Bearer aaas-broker"}, nil)
	call("forged-identity", map[string]string{
		"Authorization": "Bearer aaas-broker", "X-Api-Key": "aaas-broker",
		"X-Forwarded-For": other, "X-Real-Ip": other, "Forwarded": "for=" + other,
		"X-Forwarded-User": "bob", "X-Auth-Request-User": "bob", "X-Aaas-User": "bob",
	}, nil)
	// Leaving its own address: another pod's, as a source.
	call("source-another-pod", nil, &net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(other)}})
	// A raw socket would let it write packets with any source address.
	if fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_TCP); err != nil {
		fmt.Printf("raw-socket refused %v\n", err)
	} else {
		syscall.Close(fd)
		fmt.Println("raw-socket opened")
	}
	// An address of its own choosing on its interface.
	if err := addAddress(); err != nil {
		fmt.Printf("add-address refused %v\n", oneLine(err.Error()))
	} else {
		fmt.Println("add-address done")
	}
	// Kubernetes API credentials.
	if _, err := os.Stat("/var/run/secrets/kubernetes.io/serviceaccount/token"); errors.Is(err, os.ErrNotExist) {
		fmt.Println("service-account-token absent")
	} else {
		fmt.Printf("service-account-token present %v\n", err)
	}
}

// addAddress asks the kernel to give the pod's interface another
// address (what `ip addr add` does), which needs NET_ADMIN.
func addAddress() error {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW, syscall.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	// RTM_NEWADDR for 10.255.255.254/32 on interface 2 (eth0 in a pod).
	var msg bytes.Buffer
	payload := []byte{syscall.AF_INET, 32, 0, 0, 2, 0, 0, 0} // ifaddrmsg
	attr := []byte{8, 0, syscall.IFA_LOCAL, 0, 10, 255, 255, 254}
	n := uint32(16 + len(payload) + len(attr))
	hdr := []byte{byte(n), byte(n >> 8), byte(n >> 16), byte(n >> 24),
		syscall.RTM_NEWADDR, 0, byte((syscall.NLM_F_REQUEST | syscall.NLM_F_ACK | syscall.NLM_F_CREATE) & 0xff), byte((syscall.NLM_F_REQUEST | syscall.NLM_F_ACK | syscall.NLM_F_CREATE) >> 8),
		1, 0, 0, 0, 0, 0, 0, 0}
	msg.Write(hdr)
	msg.Write(payload)
	msg.Write(attr)
	if err := syscall.Sendto(fd, msg.Bytes(), 0, &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK}); err != nil {
		return err
	}
	buf := make([]byte, 4096)
	k, _, err := syscall.Recvfrom(fd, buf, 0)
	if err != nil {
		return err
	}
	// An NLMSG_ERROR answer carries the errno (0 for success) after the header.
	if k >= 20 && buf[4] == syscall.NLMSG_ERROR {
		if code := int32(uint32(buf[16]) | uint32(buf[17])<<8 | uint32(buf[18])<<16 | uint32(buf[19])<<24); code != 0 {
			return syscall.Errno(-code)
		}
	}
	return nil
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
