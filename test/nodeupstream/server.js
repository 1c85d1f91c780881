// A Node.js upstream for the proxy tests. DSH Web is a Node process, and
// Node's HTTP server behaves as Go's does not: it answers
// "Expect: 100-continue" on its own, may answer before it has read the
// body, and streams with chunked encoding. Routes:
//   PUT  /early    answers 201 at once, reading nothing of the body
//   PUT  /upload   reads the whole body, answers its length and sha256
//   GET  /stream   ?count=n&interval=ms: n chunks, one every interval
//   GET  /ws       WebSocket echo
//   any  /echo     the method, URL and headers it received
//   GET  /hostile  ?redirect=url: a page whose headers try to act on the
//                  whole origin or be cached for everyone, as a tenant's
//                  server could
// It prints "listening <port>" once it accepts connections.
'use strict';
const http = require('http');
const crypto = require('crypto');
const { WebSocketServer } = require('ws');

const server = http.createServer((req, res) => {
  const url = new URL(req.url, 'http://upstream');
  switch (url.pathname) {
    case '/early':
      res.writeHead(201, { 'Content-Type': 'text/plain' });
      res.end('created before reading\n');
      return;
    case '/upload': {
      const hash = crypto.createHash('sha256');
      let n = 0;
      req.on('data', (chunk) => { n += chunk.length; hash.update(chunk); });
      req.on('end', () => {
        res.writeHead(200, { 'Content-Type': 'application/json' });
        res.end(JSON.stringify({ bytes: n, sha256: hash.digest('hex') }));
      });
      return;
    }
    case '/stream': {
      const count = Number(url.searchParams.get('count') || 3);
      const interval = Number(url.searchParams.get('interval') || 100);
      res.writeHead(200, { 'Content-Type': 'text/event-stream' });
      let i = 0;
      const t = setInterval(() => {
        res.write(`data: ${i}\n\n`);
        if (++i >= count) { clearInterval(t); res.end(); }
      }, interval);
      req.on('close', () => clearInterval(t));
      return;
    }
    case '/hostile': {
      const headers = [
        'Content-Type', 'text/plain',
        'Set-Cookie', 'dsh_gw_session=stolen; Path=/',
        'Service-Worker-Allowed', '/',
        'Clear-Site-Data', '"*"',
        'Strict-Transport-Security', 'max-age=31536000; includeSubDomains',
        'X-Accel-Redirect', '/internal/',
        'Refresh', '0; url=/elsewhere',
        'Connection', 'X-Hop-One',
        'Connection', 'X-Hop-Two',
        'X-Hop-One', '1',
        'X-Hop-Two', '2',
        'X-Kept', 'yes',
        // Shared caches may keep it, says the tenant: the edge must not
        // let a cache in front hand it to another user.
        'Cache-Control', 'public, max-age=86400, s-maxage=86400',
        'Vary', 'Accept-Encoding',
      ];
      const redirect = url.searchParams.get('redirect');
      if (redirect) headers.push('Location', redirect);
      res.writeHead(redirect ? 302 : 200, headers);
      res.end('hostile\n');
      return;
    }
    case '/echo':
      res.writeHead(200, { 'Content-Type': 'application/json' });
      res.end(JSON.stringify({ method: req.method, url: req.url, headers: req.headers }));
      return;
  }
  res.writeHead(404, { 'Content-Type': 'text/plain' });
  res.end('not found\n');
});

const wss = new WebSocketServer({ noServer: true });
server.on('upgrade', (req, socket, head) => {
  if (new URL(req.url, 'http://upstream').pathname !== '/ws') {
    socket.destroy();
    return;
  }
  wss.handleUpgrade(req, socket, head, (ws) => {
    ws.on('message', (data, isBinary) => ws.send(data, { binary: isBinary }));
  });
});

server.listen(Number(process.env.PORT || 0), '127.0.0.1', () => {
  console.log(`listening ${server.address().port}`);
});
