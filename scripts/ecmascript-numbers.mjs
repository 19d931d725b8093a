// Prints `count` random finite doubles as "<16 hex digits of the IEEE 754
// bits> <ECMAScript String(x)>", one a line: the reference that
// tests/rfc8785.rs checks idem's number form against.
// Usage: node scripts/ecmascript-numbers.mjs 1000000 > numbers.txt
const count = Number(process.argv[2] ?? 1000);
const buf = new DataView(new ArrayBuffer(8));
const out = [];
for (let i = 0; i < count; ) {
  // Random bit patterns cover every exponent; every tenth is a "decimal"
  // value (few digits), where shortest-digit ties live.
  if (i % 10 === 0) {
    const digits = Math.floor(Math.random() * 1e6);
    const exp = Math.floor(Math.random() * 40) - 20;
    buf.setFloat64(0, Number(`${digits}e${exp}`) * (Math.random() < 0.5 ? -1 : 1));
  } else {
    buf.setUint32(0, Math.floor(Math.random() * 2 ** 32));
    buf.setUint32(4, Math.floor(Math.random() * 2 ** 32));
  }
  const x = buf.getFloat64(0);
  if (!Number.isFinite(x)) continue;
  const hex = buf.getBigUint64(0).toString(16).padStart(16, "0");
  out.push(`${hex} ${String(x)}`);
  i++;
  if (out.length >= 10000) {
    process.stdout.write(out.join("\n") + "\n");
    out.length = 0;
  }
}
if (out.length) process.stdout.write(out.join("\n") + "\n");
