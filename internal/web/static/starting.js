// Reloads once the sandbox is Ready; retries the whole page if the stream fails.
followStatus((s, es) => {
  if (s.phase === "Ready") { es.close(); location.reload(); }
}).onerror = () => setTimeout(() => location.reload(), 3000);
