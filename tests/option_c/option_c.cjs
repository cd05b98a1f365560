// "Option C" of "RabbitMQ Retries — The (new) Full Story"
// (../shared/seeds/000_*, 003_*), written with amqplib from the seed's
// text: a notification exchange fanning out to email-queue and
// webhook-queue, both dead-lettering to error-exchange; error-queue's
// consumer republishes a rejected message to the x-delayed-message
// wait-exchange with a delay from its curve (by x-death's rejected
// count); requeue-queue, bound to wait-exchange, sends it back to
// x-first-death-queue. Topology and flow as in the seed, one channel as
// in the seed. tests/it/option_c.rs runs it through nackd.
//
// Where the seed's text cannot run as written, and what this does instead:
// - its consumers `await` inside non-async callbacks: they are async here;
// - it publishes the delay as `x-wait`, a header the plugin ignores (every
//   retry would be routed at once): `x-delay` here, the plugin's header;
// - it declares wait-exchange without `x-delayed-type`, which the plugin
//   refuses (406): `x-delayed-type: fanout` here (one unkeyed binding);
// - its delay curve (500, 30 000, 3 600, 18 000 ms; its comments say
//   0.5 s, 5 s, 1 min, 5 min) is the default; OPTION_C_DELAYS shortens it;
// - emailService / webhookService are a stand-in that fails each message
//   a given number of times (OPTION_C_MESSAGES), then succeeds;
// - every name gets OPTION_C_PREFIX, so runs never share a queue.
//
// Environment: AMQPLIB (amqplib's directory), AMQP_URL, OPTION_C_PREFIX,
// OPTION_C_MESSAGES (JSON {id: failures per work queue, -1: always}),
// OPTION_C_DELAYS (ms, comma-separated), OPTION_C_LIMIT_MS.
//
// Output: one JSON event a line on stdout, each with `t` (ms since the
// epoch): published, fail, done, wait (published to wait-exchange: queue,
// count, delay), requeue (arrived in requeue-queue: queue), exhausted,
// not-rejected, then `end` (all settled) or `timeout` (exit 1).
'use strict'

const path = require('node:path')
const amqp = require(path.join(process.env.AMQPLIB, 'channel_api.js'))

const PREFIX = process.env.OPTION_C_PREFIX || ''
const name = (n) => PREFIX + n
const MESSAGES = JSON.parse(process.env.OPTION_C_MESSAGES || '{"m1": 1}')
const REQUEUE_DELAY_DURATIONS = (process.env.OPTION_C_DELAYS || '500,30000,3600,18000')
  .split(',')
  .map(Number)
const LIMIT_MS = Number(process.env.OPTION_C_LIMIT_MS || 120000)

const emit = (ev) => console.log(JSON.stringify({ ...ev, t: Date.now() }))

// One copy of each message per work queue; settled once done or exhausted.
const pending = new Set()
for (const id of Object.keys(MESSAGES)) {
  for (const q of ['email-queue', 'webhook-queue']) pending.add(`${name(q)} ${id}`)
}
let finish
const allSettled = new Promise((resolve) => {
  finish = resolve
})
const settle = (queue, id) => {
  pending.delete(`${queue} ${id}`)
  if (pending.size === 0) finish()
}

// The external services: each fails a message MESSAGES[id] times (-1:
// always), then succeeds.
const attempts = new Map()
const service = (queue) => ({
  async send(msg) {
    const id = msg.properties.messageId
    const key = `${queue} ${id}`
    const n = (attempts.get(key) ?? 0) + 1
    attempts.set(key, n)
    const fails = MESSAGES[id]
    if (fails === -1 || n <= fails) throw new Error(`${queue}: ${id} fails (attempt ${n})`)
  },
})
const emailService = service(name('email-queue'))
const webhookService = service(name('webhook-queue'))

async function main() {
  const connection = await amqp.connect(process.env.AMQP_URL)
  connection.on('error', (err) => {
    emit({ ev: 'error', message: String(err && err.message) })
    process.exit(2)
  })
  const amqpChannel = await connection.createChannel()

  // Create exchanges and queues
  await Promise.all([
    amqpChannel.assertExchange(name('notification-exchange'), 'fanout'),
    amqpChannel.assertExchange(name('error-exchange'), 'fanout'),
    // Our new delayed exchange
    amqpChannel.assertExchange(name('wait-exchange'), 'x-delayed-message', {
      arguments: { 'x-delayed-type': 'fanout' },
    }),
  ])
  await Promise.all([
    amqpChannel.assertQueue(name('email-queue'), {
      deadLetterExchange: name('error-exchange'),
    }),
    amqpChannel.assertQueue(name('webhook-queue'), {
      deadLetterExchange: name('error-exchange'),
    }),
    // Our new error handling queue
    amqpChannel.assertQueue(name('error-queue')),
    amqpChannel.assertQueue(name('requeue-queue')),
  ])

  // Bind queues
  await Promise.all([
    amqpChannel.bindQueue(name('email-queue'), name('notification-exchange'), ''),
    amqpChannel.bindQueue(name('webhook-queue'), name('notification-exchange'), ''),
    // New bindings with intermediate error queue
    amqpChannel.bindQueue(name('error-queue'), name('error-exchange'), ''),
    amqpChannel.bindQueue(name('requeue-queue'), name('wait-exchange'), ''),
  ])

  const worker = (queue, svc) => async (msg) => {
    const id = msg.properties.messageId
    try {
      await svc.send(msg)
      amqpChannel.ack(msg)
      emit({ ev: 'done', queue, id })
      settle(queue, id)
    } catch (err) {
      console.error(err.message)
      amqpChannel.nack(msg, false, false)
      //                       ^ Don't requeue !
      emit({ ev: 'fail', queue, id })
    }
  }

  // Consume email
  await amqpChannel.consume(name('email-queue'), worker(name('email-queue'), emailService))

  // Consume webhook
  await amqpChannel.consume(name('webhook-queue'), worker(name('webhook-queue'), webhookService))

  // Consume and handle error
  await amqpChannel.consume(name('error-queue'), async (msg) => {
    const id = msg.properties.messageId
    const queue = msg.properties.headers['x-first-death-queue']
    const reason = msg.properties.headers['x-first-death-reason']

    // Here we can control which discard reasons
    // for which the message should be requeued
    // I'm only keeping 'rejected' (`nack`s) ones here
    if (reason !== 'rejected') {
      amqpChannel.ack(msg)
      emit({ ev: 'not-rejected', queue, id, reason })
      return
    }
    // Get number of rejects from header
    const xDeaths = msg.properties.headers['x-death']
    const rejectsCount = xDeaths.find((d) => d.reason === 'rejected')?.count ?? -1

    // Not a rejection
    if (rejectsCount <= 0) {
      amqpChannel.ack(msg)
      emit({ ev: 'not-rejected', queue, id, count: rejectsCount })
      return
    }

    // Find duration to wait
    // before next requeue
    const nextRequeueIndex = rejectsCount - 1
    const nextRequeueDuration = REQUEUE_DELAY_DURATIONS[nextRequeueIndex] ?? null

    // Msg reached max requeue amount
    if (nextRequeueDuration == null) {
      amqpChannel.ack(msg)
      emit({ ev: 'exhausted', queue, id, count: rejectsCount })
      settle(queue, id)
      return
    }

    // Send message to the wait-exchange
    emit({ ev: 'wait', queue, id, count: rejectsCount, delay: nextRequeueDuration })
    await amqpChannel.publish(name('wait-exchange'), '', msg.content, {
      ...msg.properties,
      headers: {
        ...msg.properties.headers,
        // Tell wait-exchange to wait for this amount
        'x-delay': nextRequeueDuration,
      },
    })

    // Don't forget to ack it from error queue
    amqpChannel.ack(msg)
  })

  // Consume and handle requeue
  await amqpChannel.consume(name('requeue-queue'), async (msg) => {
    const id = msg.properties.messageId
    const originalQueue = msg.properties.headers['x-first-death-queue']
    emit({ ev: 'requeue', queue: originalQueue, id })

    if (originalQueue == null) {
      amqpChannel.ack(msg)
      return
    }

    // Re-send the message to the queue
    // where it errored
    await amqpChannel.sendToQueue(originalQueue, msg.content, msg.properties)

    // Don't forget to ack it from requeue queue
    amqpChannel.ack(msg)
  })

  // The events this service reads, one per message.
  for (const id of Object.keys(MESSAGES)) {
    amqpChannel.publish(name('notification-exchange'), '', Buffer.from(JSON.stringify({ id })), {
      messageId: id,
      contentType: 'application/json',
    })
    emit({ ev: 'published', id })
  }

  let timer
  const timedOut = await Promise.race([
    allSettled.then(() => false),
    new Promise((resolve) => {
      timer = setTimeout(() => resolve(true), LIMIT_MS)
    }),
  ])
  clearTimeout(timer)
  if (timedOut) {
    emit({ ev: 'timeout', pending: [...pending] })
    process.exit(1)
  }
  emit({ ev: 'end' })
  await connection.close()
}

main().catch((err) => {
  console.error(err)
  emit({ ev: 'error', message: String(err && err.message) })
  process.exit(2)
})
